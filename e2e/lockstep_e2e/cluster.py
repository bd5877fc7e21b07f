"""A real Kubernetes control plane on loopback: etcd, kube-apiserver,
kube-controller-manager, kube-scheduler and kwok (simulated nodes and pods).

``LocalCluster`` starts everything in order, waits until the cluster can
schedule a pod, writes an admin kubeconfig, and stops every process it
started, on exit or on failure. Children are also bound to this process with
PR_SET_PDEATHSIG, so a killed test run leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import random
import signal
import socket
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import urllib3
import yaml
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from lockstep_e2e import build
from lockstep_e2e.pki import CertificateAuthority, KeyPair, write_signing_key

COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
KWOK_STAGES = Path(__file__).with_name("kwok-stages.yaml")
SERVICE_CIDR = "10.96.0.0/16"
POD_CIDR = "10.244.0.0/16"
KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"
# How long a stopped process may take to exit on SIGTERM before it is killed.
STOP_GRACE_SECONDS = 10.0
# Admission plugins on top of the apiserver's defaults, as kubeadm clusters run them.
EXTRA_ADMISSION_PLUGINS = "NodeRestriction"
# Every request's metadata (who, verb, URI with its selectors, response code) goes to audit.log.
AUDIT_POLICY = """\
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["RequestReceived"]
rules:
- level: Metadata
"""


class ClusterError(RuntimeError):
    """The control plane could not be started; the message names the component and its log."""


_HANDED_OUT: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A loopback port that is free now, below the kernel's ephemeral range.

    A port the kernel hands out for ``bind(0)`` can be given again, a moment later, as the
    source port of an outgoing connection, before the server meant to listen on it starts.
    Ports below the ephemeral range are never used that way; each is handed out once per process.
    """
    low, _ = _ephemeral_range()
    while True:
        port = random.randrange(10000, low)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGKILL it when the parent dies."""
    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


@dataclass
class Component:
    """One control-plane process and its log file."""

    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] | None = None
    own_group: bool = False
    """Start it in a process group of its own, as a container: SIGTERM goes to the main process (the kubelet's
    signal to PID 1), SIGKILL to the whole group (every process of a container dies with it)."""
    process: subprocess.Popen[bytes] | None = None
    _log: IO[bytes] | None = None

    def start(self) -> None:
        self._log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            self.argv,
            env=None if self.env is None else {**os.environ, **self.env},
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=_die_with_parent,
            start_new_session=self.own_group,
        )

    def send(self, number: signal.Signals) -> None:
        """Send ``number`` to the process if it runs (SIGKILL to its whole group, with ``own_group``)."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            if self.own_group and number is signal.SIGKILL:
                os.killpg(self.process.pid, number)  # children that outlived the main process too
            elif self.process.poll() is None:
                self.process.send_signal(number)

    def start_until_answering(self, url: str, timeout: float) -> None:
        """Start, and return once ``url`` (its health or readiness endpoint) answers; else stop it and raise."""
        self.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                with urllib.request.urlopen(url, timeout=2):
                    return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise ClusterError(f"{self.name} did not answer {url} within {timeout:.0f}s:\n{self.log_tail()}")

    def check_alive(self) -> None:
        if self.process is not None and self.process.poll() is not None:
            raise ClusterError(
                f"{self.name} exited with code {self.process.returncode}; last lines of {self.log_path}:\n"
                + self.log_tail()
            )

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, grace_seconds: float = STOP_GRACE_SECONDS) -> None:
        """SIGTERM, then SIGKILL if it still runs after ``grace_seconds``; returns once it has exited."""
        stop_all([[self]], grace_seconds)


def stop_all(waves: list[list[Component]], grace_seconds: float = STOP_GRACE_SECONDS) -> None:
    """Stop the components of each wave together, wave after wave: SIGTERM to every one of a wave at once,
    the next wave once those have exited; SIGKILL to any still running ``grace_seconds`` after the first
    signal; then wait for every one. So it returns within ``grace_seconds`` and a moment, however many hang."""
    deadline = time.monotonic() + grace_seconds
    for wave in waves:
        running = [c for c in wave if c.process is not None and c.process.poll() is None]
        for component in running:
            component.send(signal.SIGTERM)
        for process in [c.process for c in running if c.process is not None]:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break  # the grace period is over
    components = [c for wave in waves for c in wave]
    for component in components:
        component.send(signal.SIGKILL)
        if component.process is not None:
            component.process.wait()
        if component._log is not None:
            component._log.close()


@dataclass
class LocalCluster:
    """A control plane rooted in ``workdir`` (certificates, etcd data, logs, kubeconfig).

    ``nodes`` simulated kwok nodes are created, each with ``node_pods`` pod slots. ``stop`` gives the
    components ``stop_grace_seconds`` to exit on SIGTERM before it kills them.
    """

    workdir: Path
    nodes: int = 2
    node_pods: int = 1100
    stop_grace_seconds: float = STOP_GRACE_SECONDS
    bin_dir: Path = field(default_factory=build.bin_dir)
    components: list[Component] = field(default_factory=list)
    kubeconfig: Path = field(init=False)

    def __post_init__(self) -> None:
        self.kubeconfig = self.workdir / "kubeconfig"
        self.apiserver_port = free_port()

    # -- lifecycle -----------------------------------------------------------------

    def start(self, timeout: float = 180.0) -> LocalCluster:
        """Start every component and wait until pods can be scheduled; on failure stop all and raise."""
        missing = [name for name in build.BINARIES if not (self.bin_dir / name).is_file()]
        if missing:
            raise ClusterError(
                f"missing control-plane binaries {missing} in {self.bin_dir}; build them with "
                "`python -m lockstep_e2e.build` (or `make binaries`)"
            )
        self.workdir.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + timeout
        try:
            credentials = self._write_credentials()
            etcd_port = free_port()
            self._launch("etcd", self._etcd_args(etcd_port))
            self._wait("etcd to accept connections", deadline, lambda: port_open(etcd_port))
            self._launch("kube-apiserver", self._apiserver_args(etcd_port, credentials))
            self._wait("kube-apiserver to report ready", deadline, self._apiserver_ready)
            self._launch("kube-controller-manager", self._controller_manager_args(credentials))
            self._launch("kube-scheduler", self._scheduler_args(credentials))
            self._launch("kwok", self._kwok_args(credentials))
            self._create_nodes()
            self._wait("kwok to mark the nodes Ready", deadline, self._nodes_ready)
            self._wait("the controller manager to create the default service account", deadline, self._default_sa)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop every process this cluster started: all at once, but etcd once the others have exited (an
        API server whose etcd is gone does not finish its shutdown); returns within ``stop_grace_seconds``
        and a moment (see ``stop_all``)."""
        clients = [c for c in self.components if c.name != "etcd"]
        storage = [c for c in self.components if c.name == "etcd"]
        stop_all([clients, storage], self.stop_grace_seconds)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def pids(self) -> list[int]:
        return [c.process.pid for c in self.components if c.process is not None]

    def api_client(self) -> client.ApiClient:
        api: client.ApiClient = config.new_client_from_config(config_file=str(self.kubeconfig))
        return api

    def version(self) -> str:
        """``kube-apiserver --version`` of the binary this cluster runs."""
        out = subprocess.run([str(self.bin_dir / "kube-apiserver"), "--version"], capture_output=True, text=True)
        return out.stdout.strip()

    # -- internals -----------------------------------------------------------------

    def _launch(self, name: str, args: list[str]) -> None:
        component = Component(name, [str(self.bin_dir / name), *args], self.workdir / f"{name}.log")
        self.components.append(component)
        component.start()

    def _wait(self, what: str, deadline: float, ready: Callable[[], bool]) -> None:
        while time.monotonic() < deadline:
            for component in self.components:
                component.check_alive()
            try:
                if ready():
                    return
            except (OSError, ApiException, urllib3.exceptions.HTTPError):
                pass  # not up yet: connection refused, 500 from /readyz, 403 during RBAC bootstrap, ...
            time.sleep(0.25)
        logs = "\n\n".join(f"--- {c.name} ({c.log_path}) ---\n{c.log_tail()}" for c in self.components)
        raise ClusterError(f"timed out waiting for {what}\n{logs}")

    def _write_credentials(self) -> dict[str, KeyPair]:
        pki = self.workdir / "pki"
        pki.mkdir(exist_ok=True)
        ca = CertificateAuthority(pki)
        credentials = {
            "ca": ca.pair,
            "service-accounts": write_signing_key(pki),
            "apiserver": ca.issue(
                "apiserver",
                "kube-apiserver",
                server_hosts=(
                    "127.0.0.1",
                    "localhost",
                    "10.96.0.1",
                    "kubernetes",
                    "kubernetes.default",
                    "kubernetes.default.svc",
                ),
            ),
            "admin": ca.issue("admin", "lockstep-admin", "system:masters"),
            "kube-controller-manager": ca.issue("controller-manager", "system:kube-controller-manager"),
            "kube-scheduler": ca.issue("scheduler", "system:kube-scheduler"),
            # kwok plays every kubelet at once, so it cannot be one system:node identity.
            "kwok": ca.issue("kwok", "kwok", "system:masters"),
        }
        for user in ("admin", "kube-controller-manager", "kube-scheduler", "kwok"):
            pair = credentials[user]
            self._write_kubeconfig(
                self._kubeconfig_path(user), user, {"client-certificate": str(pair.cert), "client-key": str(pair.key)}
            )
        return credentials

    def token_kubeconfig(self, name: str, token: str) -> Path:
        """A kubeconfig that authenticates with a bearer token (a service account's)."""
        path = self.workdir / f"{name}.kubeconfig"
        self._write_kubeconfig(path, name, {"token": token})
        return path

    @property
    def audit_log(self) -> Path:
        return self.workdir / "audit.log"

    def audit_events(self) -> list[dict[str, Any]]:
        """Every request the API server has answered so far (audit.k8s.io/v1 Events)."""
        return [json.loads(line) for line in self.audit_log.read_text().splitlines() if line.strip()]

    def _kubeconfig_path(self, user: str) -> Path:
        return self.kubeconfig if user == "admin" else self.workdir / f"{user}.kubeconfig"

    def _write_kubeconfig(self, path: Path, user: str, credentials: dict[str, str]) -> None:
        document = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "lockstep-local",
                    "cluster": {
                        "server": f"https://127.0.0.1:{self.apiserver_port}",
                        "certificate-authority": str(self.workdir / "pki" / "ca.crt"),
                    },
                }
            ],
            "users": [{"name": user, "user": credentials}],
            "contexts": [{"name": "lockstep-local", "context": {"cluster": "lockstep-local", "user": user}}],
            "current-context": "lockstep-local",
        }
        path.write_text(yaml.safe_dump(document))

    def _etcd_args(self, port: int) -> list[str]:
        peer = f"http://127.0.0.1:{free_port()}"
        return [
            "--name=local",
            f"--data-dir={self.workdir / 'etcd'}",
            f"--listen-client-urls=http://127.0.0.1:{port}",
            f"--advertise-client-urls=http://127.0.0.1:{port}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=local={peer}",
            # Test data is thrown away: skip fsync so a slow disk does not stall the API server.
            "--unsafe-no-fsync",
            "--log-level=warn",
        ]

    def _apiserver_args(self, etcd_port: int, credentials: dict[str, KeyPair]) -> list[str]:
        sa = credentials["service-accounts"]
        return [
            f"--etcd-servers=http://127.0.0.1:{etcd_port}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={self.apiserver_port}",
            f"--tls-cert-file={credentials['apiserver'].cert}",
            f"--tls-private-key-file={credentials['apiserver'].key}",
            f"--client-ca-file={credentials['ca'].cert}",
            "--authorization-mode=Node,RBAC",
            f"--enable-admission-plugins={EXTRA_ADMISSION_PLUGINS}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={sa.cert}",
            f"--service-account-signing-key-file={sa.key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            f"--cert-dir={self.workdir / 'pki'}",
            f"--audit-policy-file={self._write_audit_policy()}",
            f"--audit-log-path={self.audit_log}",
            "--audit-log-format=json",
            # The apiserver refuses to publish a loopback address as the `kubernetes` Service's endpoint.
            "--endpoint-reconciler-type=none",
            "--profiling=false",
            "--v=1",
        ]

    def _write_audit_policy(self) -> Path:
        path = self.workdir / "audit-policy.yaml"
        path.write_text(AUDIT_POLICY)
        return path

    def _component_kubeconfig_args(self, user: str) -> list[str]:
        path = self._kubeconfig_path(user)
        return [f"--kubeconfig={path}", f"--authentication-kubeconfig={path}", f"--authorization-kubeconfig={path}"]

    def _controller_manager_args(self, credentials: dict[str, KeyPair]) -> list[str]:
        return [
            *self._component_kubeconfig_args("kube-controller-manager"),
            f"--service-account-private-key-file={credentials['service-accounts'].key}",
            f"--root-ca-file={credentials['ca'].cert}",
            "--use-service-account-credentials=true",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
            f"--secure-port={free_port()}",
            "--profiling=false",
            "--v=1",
        ]

    def _scheduler_args(self, credentials: dict[str, KeyPair]) -> list[str]:
        return [
            *self._component_kubeconfig_args("kube-scheduler"),
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
            f"--secure-port={free_port()}",
            "--profiling=false",
            "--v=1",
        ]

    def _kwok_args(self, credentials: dict[str, KeyPair]) -> list[str]:
        return [
            f"--kubeconfig={self._kubeconfig_path('kwok')}",
            f"--config={KWOK_STAGES}",
            f"--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}=fake",
            f"--cidr={POD_CIDR}",
            "--node-ip=127.0.0.1",
            "--node-lease-duration-seconds=40",
        ]

    def _create_nodes(self) -> None:
        core = client.CoreV1Api(self.api_client())
        for index in range(self.nodes):
            core.create_node(
                client.V1Node(
                    metadata=client.V1ObjectMeta(
                        name=f"kwok-node-{index}",
                        annotations={KWOK_NODE_ANNOTATION: "fake"},
                        labels={"type": "kwok", "kubernetes.io/hostname": f"kwok-node-{index}"},
                    ),
                    status=client.V1NodeStatus(
                        capacity={"cpu": "256", "memory": "2Ti", "pods": str(self.node_pods), "nvidia.com/gpu": "8"},
                    ),
                )
            )

    def _apiserver_ready(self) -> bool:
        pki = self.workdir / "pki"
        context = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        context.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
        url = f"https://127.0.0.1:{self.apiserver_port}/readyz"
        with urllib.request.urlopen(url, context=context, timeout=5) as response:
            return bool(response.read() == b"ok")

    def _nodes_ready(self) -> bool:
        nodes = client.CoreV1Api(self.api_client()).list_node().items
        ready = [
            n
            for n in nodes
            if any(c.type == "Ready" and c.status == "True" for c in ((n.status and n.status.conditions) or []))
        ]
        return len(ready) == self.nodes

    def _default_sa(self) -> bool:
        client.CoreV1Api(self.api_client()).read_namespaced_service_account("default", "default")
        return True


def port_open(port: int) -> bool:
    """Whether something listens on 127.0.0.1:``port``."""
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def main() -> None:
    """Run a cluster until interrupted: ``python -m lockstep_e2e.cluster [WORKDIR]``."""
    import sys
    import tempfile

    workdir = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="lockstep-cluster-"))
    stop_signals = {signal.SIGINT, signal.SIGTERM}
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # while starting: stop what has started, and exit
    with LocalCluster(workdir) as local:
        # Blocked before "cluster up" is said, so a stop signal sent as soon as it is read waits in sigwait: with
        # signal.pause() one that arrived between Python's signal check and the pause was lost, and it hung.
        signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
        print(f"cluster up: export KUBECONFIG={local.kubeconfig}  (Ctrl-C stops it)", flush=True)
        signal.sigwait(stop_signals)
        print("stopping the cluster", flush=True)


if __name__ == "__main__":
    main()
