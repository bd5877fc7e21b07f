"""The local demo: a real control plane, Lockstep installed, the operator running, a sample RLJob,
and two in-flight weight updates through the barrier (simulated agents in the actor pods).

``python -m lockstep_e2e.demo [--keep]`` (``make demo`` builds what it needs first).
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import subprocess
import time
from pathlib import Path

import yaml
from kubernetes import client

from lockstep_e2e import build
from lockstep_e2e.agents import running_agents
from lockstep_e2e.cluster import LocalCluster
from lockstep_e2e.install import REPO, install, start_operator
from lockstep_e2e.jobs import announce_weights, create_job, get_job, phase

SAMPLE = REPO / "examples" / "rljob-tiny.yaml"
NAMESPACE = "demo"


def step(message: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {message}", flush=True)


def kubectl(cluster: LocalCluster, *args: str) -> None:
    command = ["kubectl", *args]
    print(f"\n$ {' '.join(command)}", flush=True)
    subprocess.run([str(build.bin_dir() / "kubectl"), f"--kubeconfig={cluster.kubeconfig}", *args], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--workdir", type=Path, default=REPO / "out" / "demo", help="cluster state and logs")
    parser.add_argument("--keep", action="store_true", help="keep the cluster running until Ctrl-C")
    options = parser.parse_args()
    workdir: Path = options.workdir
    if workdir.exists():
        subprocess.run(["rm", "-rf", str(workdir)], check=True)
    workdir.mkdir(parents=True)

    step(f"starting the local control plane ({build.KUBERNETES_VERSION}, etcd, kwok) in {workdir}")
    with LocalCluster(workdir) as cluster:
        api = cluster.api_client()
        step("installing the CRDs, admission policies and the default ParityPolicy from crds/")
        install(api)
        step("starting the operator (log: out/demo/operator.log)")
        operator = start_operator(cluster, workdir / "operator.log")
        try:
            client.CoreV1Api(api).create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=NAMESPACE)))
            manifest = yaml.safe_load(SAMPLE.read_text())
            name = manifest["metadata"]["name"]
            step(f"applying {SAMPLE.relative_to(REPO)} in namespace {NAMESPACE}")
            create_job(api, NAMESPACE, manifest)
            deadline = time.monotonic() + 120
            while phase(get_job(api, NAMESPACE, name)) != "Running":
                if time.monotonic() > deadline:
                    raise SystemExit(f"RLJob {name} did not reach Running; see {workdir / 'operator.log'}")
                time.sleep(0.5)
            step(f"RLJob {name} is Running")
            actors = [f"{name}-actor-{i}" for i in range(manifest["spec"]["actors"]["replicas"])]
            with running_agents(api, NAMESPACE, actors):
                for version in (1, 2):
                    step(f"the trainer announces weights version {version}; the operator runs the barrier")
                    announce_weights(api, NAMESPACE, name, version)
                    while get_job(api, NAMESPACE, name)["status"].get("weightsVersion") != version:
                        time.sleep(0.2)
            step("every actor paused, loaded and resumed twice (simulated agents, no-op loads)")
            kubectl(cluster, "get", "paritypolicies")
            kubectl(cluster, "get", "rljobs", "-n", NAMESPACE)
            kubectl(cluster, "get", "pods", "-n", NAMESPACE, "-o", "wide")
            kubectl(
                cluster,
                "get",
                "events",
                "-n",
                NAMESPACE,
                "--field-selector=involvedObject.kind=RLJob",
                "--sort-by=.metadata.creationTimestamp",
            )
            history = (
                "{range .status.barrierHistory[*]}{.version}{'  '}{.outcome}{'  '}{.seconds}s"
                "{'  slowest: '}{.slowestPod}{'\\n'}{end}"
            )
            kubectl(cluster, "get", "rljob", name, "-n", NAMESPACE, "-o", f"jsonpath={history}")
            if options.keep:
                print(f"\nThe cluster keeps running: export KUBECONFIG={cluster.kubeconfig}  (Ctrl-C stops it)")
                signal.signal(signal.SIGTERM, signal.default_int_handler)
                with contextlib.suppress(KeyboardInterrupt):
                    signal.pause()
        finally:
            operator.stop()
    step("stopped the operator and the control plane")


if __name__ == "__main__":
    main()
