"""Run kwok pods' real container commands as local processes: the kubelet part kwok does not play.

kwok keeps each pod's status; this runs what the pod would run, with the pod's command, arguments
and environment (fieldRefs resolved), authenticated as the pod's service account with a token bound
to the pod (what the kubelet would mount), through a kubeconfig instead of the in-cluster files.
Volumes map to local directories: a hostPath to its own path, a configMap to its keys written out,
an emptyDir to a fresh directory (but /tmp stays the machine's own, where the tests' paths are), each with its
``subPath`` below it. A mount with a ``subPath`` (the job's own directory of the shared volume, whose paths the
pods announce) is real: the process runs in a mount namespace of its own (``unshare``, as root) where that
directory is bind-mounted at its ``mountPath``, read-only when the mount is; there ``hosts`` names (trainer rank
0's DNS name) resolve to 127.0.0.1 too. Paths under any other mount, in the environment and arguments, are
rewritten to the local directory.

``JobPods`` runs every pod of an RLJob this way, on local ports (each actor's own; the trainer is
pointed at them), reports a process's exit as the pod's phase, and stops a process once its pod is
deleted, as a kubelet does. The pods of an actor group (LeaderWorkerSet's) run so too, their leader's address
resolving to 127.0.0.1; the group's rendezvous port is fixed, so one group at a time.
"""

from __future__ import annotations

import contextlib
import logging
import shlex
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from lockstep import keys
from lockstep.desired import JobRef, pod_name, rank0_name, trainer_host
from lockstep.environment import GROUP_LEADER_ADDRESS
from lockstep_e2e.cluster import Component, LocalCluster, free_port
from lockstep_e2e.install import read_pod, service_account_token
from lockstep_e2e.jobs import get_job
from lockstep_e2e.scrape import scrape

logger = logging.getLogger(__name__)


def local_volume(logs: Path, pod: str, volume: str) -> Path:
    """The local directory standing in for a pod's configMap or emptyDir volume (beside the pod's log)."""
    return logs / f"{pod}-volumes" / volume


def local_mounts(api: client.ApiClient, namespace: str, pod: dict[str, Any], logs: Path) -> dict[str, Path]:
    """mountPath -> the local directory standing in for it."""
    volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
    mounts = {}
    for mount in pod["spec"]["containers"][0].get("volumeMounts", []):
        volume = volumes[mount["name"]]
        if "projected" in volume:
            continue  # the service account token: given through the kubeconfig instead
        if "emptyDir" in volume and mount["mountPath"] == "/tmp":
            continue  # the pod's scratch /tmp: the machine's own, which holds the tests' model and data (tmp_path)
        if "hostPath" in volume:
            local = Path(volume["hostPath"]["path"])
        elif "configMap" in volume:
            local = local_volume(logs, pod["metadata"]["name"], mount["name"])
            data = client.CoreV1Api(api).read_namespaced_config_map(volume["configMap"]["name"], namespace).data
            local.mkdir(parents=True, exist_ok=True)
            for key, text in (data or {}).items():
                (local / key).write_text(text)
        elif "emptyDir" in volume:
            local = local_volume(logs, pod["metadata"]["name"], mount["name"])
        else:
            raise ValueError(f"the pod runner cannot stand in for volume {volume['name']!r}: {sorted(volume)}")
        local = local / mount.get("subPath", "")
        local.mkdir(parents=True, exist_ok=True)
        mounts[mount["mountPath"]] = local
    return mounts


def in_pod_namespace(argv: list[str], bound: dict[str, tuple[Path, bool]], hosts: Path | None) -> list[str]:
    """``argv`` run in a mount namespace of its own, where each ``bound`` mountPath is its local directory
    (read-only when flagged), over a tmpfs on the mountPath's parent, and /etc/hosts is ``hosts`` if given."""
    script = ["set -e"]
    for parent in sorted({str(Path(path).parent) for path in bound}):
        Path(parent).mkdir(parents=True, exist_ok=True)  # an empty mount point on this machine
        script.append(f"mount -t tmpfs lockstep-pod {shlex.quote(parent)}")
    for path, (local, read_only) in sorted(bound.items()):
        script += [f"mkdir -p {shlex.quote(path)}", f"mount --bind {shlex.quote(str(local))} {shlex.quote(path)}"]
        if read_only:
            script.append(f"mount -o remount,bind,ro {shlex.quote(path)}")
    if hosts is not None:
        script.append(f"mount --bind {shlex.quote(str(hosts))} /etc/hosts")
    script.append('exec "$@"')
    return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", "\n".join(script), "sh", *argv]


def _localize(value: str, mounts: dict[str, Path]) -> str:
    """``value`` with a path under a mount (possibly after ``--flag=``) moved to the local directory."""
    flag, equals, path = value.rpartition("=") if value.startswith("--") else ("", "", value)
    for mount, local in mounts.items():
        if path == mount or path.startswith(mount.rstrip("/") + "/"):
            return f"{flag}{equals}{local}{path[len(mount.rstrip('/')) :]}"
    return value


def _field(pod: dict[str, Any], path: str) -> str:
    value: Any = pod
    for part in path.split("."):
        value = value[part]
    return str(value)


def run_pod(
    cluster: LocalCluster,
    api: client.ApiClient,
    namespace: str,
    pod: str,
    log: Path,
    *,
    env: dict[str, str] | None = None,
    args: dict[str, str] | None = None,
    command: list[str] | None = None,
    hosts: list[str] | None = None,
) -> Component:
    """Start the pod's first container locally; the caller stops the returned Component.

    ``env`` overrides environment variables; ``args`` replaces the values of ``--flag=value`` arguments;
    ``command`` replaces the container's command and arguments (a test's probe in the pod's place); ``hosts``
    resolve to 127.0.0.1 in the pod.
    """
    body = read_pod(api, namespace, pod)
    container = body["spec"]["containers"][0]
    local = local_mounts(api, namespace, body, log.parent)
    real = {m["mountPath"]: bool(m.get("readOnly")) for m in container.get("volumeMounts", []) if m.get("subPath")}
    mounts = {path: directory for path, directory in local.items() if path not in real}
    environment = {}
    for variable in container.get("env", []):
        if "value" in variable:
            environment[variable["name"]] = _localize(variable["value"], mounts)
        elif "fieldRef" in variable.get("valueFrom", {}):
            environment[variable["name"]] = _field(body, variable["valueFrom"]["fieldRef"]["fieldPath"])
    token = service_account_token(api, namespace, body["spec"]["serviceAccountName"], pod=body, seconds=3600)
    environment["KUBECONFIG"] = str(cluster.token_kubeconfig(f"pod-{namespace}-{pod}", token))
    environment.update(env or {})
    argv = [_localize(a, mounts) for a in command or [*container.get("command", []), *container.get("args", [])]]
    for flag, value in (args or {}).items():
        argv = [f"{flag}={value}" if a.startswith(f"{flag}=") else a for a in argv]
    if argv and argv[0] == "python":
        argv[0] = sys.executable  # the project's interpreter stands in for the image's
    table = None
    if hosts:
        table = log.parent / f"{pod}-hosts"
        table.write_text(Path("/etc/hosts").read_text() + "".join(f"127.0.0.1 {name}\n" for name in hosts))
    if real or table is not None:
        argv = in_pod_namespace(argv, {path: (local[path], ro) for path, ro in real.items()}, table)
    process = Component(f"pod/{namespace}/{pod}", argv, log, env=environment, own_group=True)
    process.start()
    return process


def report_exit(api: client.ApiClient, namespace: str, pod: str, code: int) -> None:
    """Set the pod's phase from its container's exit code, as a kubelet would."""
    phase = "Succeeded" if code == 0 else "Failed"
    try:
        client.CoreV1Api(api).patch_namespaced_pod_status(pod, namespace, {"status": {"phase": phase}})
    except ApiException as error:
        if error.status != 404:
            raise


def run_to_completion(
    cluster: LocalCluster, api: client.ApiClient, namespace: str, pod: str, log: Path, timeout: float
) -> int:
    """Run the pod's container until it exits; report the exit as the pod's phase and return the code."""
    component = run_pod(cluster, api, namespace, pod, log)
    assert component.process is not None
    try:
        code = component.process.wait(timeout=timeout)
    finally:
        component.stop()
    report_exit(api, namespace, pod, code)
    return code


class JobPods:
    """The actor and trainer pods of one RLJob, run locally as a kubelet would; see the module docstring.

    Every half second: a pod that has no process yet (new, or recreated by the operator under the same
    name) gets one; a process that exited sets its pod's phase; the process of a deleted pod is stopped.
    Each actor keeps its local port across restarts, so the trainer's actor URLs stay valid; trainer
    ranks created together (the same restart count) share a fresh rendezvous port; trainer rank 0 keeps
    its ports for the collective weight transports (the pods' own, 9500 and 9501, under its DNS name, which
    resolves to 127.0.0.1 in every pod of the job: the URIs it announces are the ones a cluster sees, so two jobs
    with a collective backend cannot run here at once).
    """

    def __init__(
        self, cluster: LocalCluster, api: client.ApiClient, namespace: str, job: str, actors: int, logs: Path
    ) -> None:
        self.cluster, self.api, self.namespace, self.job, self.logs = cluster, api, namespace, job, logs
        self.urls = {pod_name(job, keys.ACTOR, i): f"http://127.0.0.1:{free_port()}" for i in range(actors)}
        """actor pod -> its local URL"""
        trainer = rank0_name(job)
        self.metrics = {**self.urls, trainer: f"http://127.0.0.1:{free_port()}"}
        """pod -> the local URL of its Prometheus /metrics (every actor; trainer rank 0)"""
        self.running: dict[str, tuple[str, Component]] = {}
        """pod name -> (pod UID, its process)"""
        self.exited: set[str] = set()
        self.retired: list[Component] = []
        self.rendezvous: dict[int, int] = {}
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="pod-runner", daemon=True)

    def start(self) -> JobPods:
        self.logs.mkdir(parents=True, exist_ok=True)
        self.sync()
        self._watcher.start()
        return self

    def sync(self) -> None:
        core = client.CoreV1Api(self.api)
        listed = core.list_namespaced_pod(self.namespace, label_selector=f"{keys.JOB}={self.job}").items
        pods = {
            str(p.metadata.name): p for p in listed if (p.metadata.labels or {}).get(keys.ROLE) != keys.PREFLIGHT_ROLE
        }
        for name, (uid, component) in list(self.running.items()):
            pod = pods.get(name)
            gone = pod is None or pod.metadata.uid != uid or pod.metadata.deletion_timestamp is not None
            code = component.process.poll() if component.process else None
            if code is not None and uid not in self.exited:
                self.exited.add(uid)
                with component.log_path.open("a") as log:
                    log.write(f"[pod runner] the container exited with code {code}\n")
                if not gone:
                    report_exit(self.api, self.namespace, name, code)
            if gone:
                component.stop(grace_seconds=60)
                self.retired.append(self.running.pop(name)[1])
        for name, pod in pods.items():
            uid = str(pod.metadata.uid)
            fresh = name not in self.running and uid not in self.exited
            phase = str(pod.status.phase)
            if fresh and pod.metadata.deletion_timestamp is None and phase in ("Pending", "Running"):
                self._run(name, uid, pod)

    def _run(self, name: str, uid: str, pod: client.V1Pod) -> None:
        overrides: dict[str, Any]
        job = get_job(self.api, self.namespace, self.job)
        hosts = [trainer_host(JobRef(self.job, self.namespace, job["metadata"]["uid"]))]
        # A pod of an actor group reaches its leader at the address LeaderWorkerSet's webhook gave it.
        env = {variable.name: str(variable.value) for variable in pod.spec.containers[0].env or [] if variable.value}
        hosts += [env[GROUP_LEADER_ADDRESS]] if GROUP_LEADER_ADDRESS in env else []
        if name in self.urls:
            overrides = {"args": {"--port": self.urls[name].rsplit(":", 1)[1]}}
        elif (pod.metadata.labels or {}).get(keys.ROLE) == keys.ACTOR_WORKER:
            overrides = {}  # vLLM's headless ranks: they serve nothing, and meet the leader at its own port
        else:
            port = self.rendezvous.setdefault(job.get("status", {}).get("restarts", 0), free_port())
            metrics = self.metrics.get(name, ":0").rsplit(":", 1)[1]
            env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "LOCKSTEP_METRICS_PORT": metrics}
            # kwok's pod IPs in the actor Service's EndpointSlices lead nowhere here: the trainer gets the local URLs.
            actors = {"LOCKSTEP_ACTORS_SERVICE": "", "LOCKSTEP_ACTORS_URL": ",".join(self.urls.values())}
            overrides = {"env": {**env, **actors}}
        log = self.logs / f"{name}.log"
        self.running[name] = (uid, run_pod(self.cluster, self.api, self.namespace, name, log, hosts=hosts, **overrides))

    def scrape_metrics(self) -> dict[str, str]:
        """The /metrics text of each running pod that serves one (every actor; trainer rank 0) and answered.

        A text counts only if its pod's process still runs once the answer is read: when a process has exited,
        its port is free for any other process on the machine to listen on, and the answer would be that one's.
        """
        texts = {}
        for name, (_, component) in list(self.running.items()):
            url = self.metrics.get(name)
            with contextlib.suppress(OSError):
                text = scrape(url) if url else None
                if text is not None and component.process is not None and component.process.poll() is None:
                    texts[name] = text
        return texts

    def log_tails(self) -> str:
        """The ending of every pod's log (a pod run again appends to the same one): what a run that stalled
        reports where only the test's output is kept (CI)."""
        components = {c.log_path: c for c in [*self.retired, *(c for _, c in self.running.values())]}
        return "\n".join(f"--- {path.name}\n{component.log_tail()}" for path, component in sorted(components.items()))

    def kill(self, name: str) -> None:
        """SIGKILL the pod's processes, as a node losing it would."""
        self.running[name][1].send(signal.SIGKILL)

    def _watch(self) -> None:
        while not self._stop.wait(0.5):
            try:
                self.sync()
            except (ApiException, urllib3.exceptions.HTTPError) as error:
                logger.warning("pod runner: %s; trying again", error)

    def stop(self) -> None:
        self._stop.set()
        if self._watcher.is_alive():
            self._watcher.join()
        for _, component in self.running.values():
            component.stop(grace_seconds=60)
        for component in self.retired:
            component.stop(grace_seconds=60)


@contextmanager
def running_pods(
    cluster: LocalCluster, api: client.ApiClient, namespace: str, job: str, actors: int, logs: Path
) -> Iterator[JobPods]:
    """Run the job's pods (the actor and trainer pods must exist) until the block ends."""
    pods = JobPods(cluster, api, namespace, job, actors, logs)
    try:
        yield pods.start()
    finally:
        pods.stop()
