"""A real Kubernetes control plane on loopback: etcd, kube-apiserver,
kube-controller-manager, kube-scheduler and kwok (simulated nodes and pods).

``LocalCluster`` starts everything in order, waits until the cluster can
schedule a pod, writes an admin kubeconfig, and stops every process it
started, on exit or on failure. Children are also bound to this process with
PR_SET_PDEATHSIG, so a killed test run leaves nothing behind.
"""

from __future__ import annotations

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
        )

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

    def stop(self, grace_seconds: float = 10.0) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=grace_seconds)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._log is not None:
            self._log.close()


@dataclass
class LocalCluster:
    """A control plane rooted in ``workdir`` (certificates, etcd data, logs, kubeconfig).

    ``nodes`` simulated kwok nodes are created, each with ``node_pods`` pod slots.
    """

    workdir: Path
    nodes: int = 2
    node_pods: int = 1100
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
            self._wait("etcd to accept connections", deadline, lambda: _port_open(etcd_port))
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
        """Stop every process this cluster started, newest first."""
        for component in reversed(self.components):
            component.stop()

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


def _port_open(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def main() -> None:
    """Run a cluster until interrupted: ``python -m lockstep_e2e.cluster [WORKDIR]``."""
    import sys
    import tempfile

    workdir = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="lockstep-cluster-"))
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with LocalCluster(workdir) as local:
        print(f"cluster up: export KUBECONFIG={local.kubeconfig}  (Ctrl-C stops it)", flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            print("stopping the cluster", flush=True)


if __name__ == "__main__":
    main()
