"""pytest fixtures: one local control plane per test session, a fresh namespace per test."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psutil
import pytest
from kubernetes import client

from lockstep_e2e.agents import running_agents
from lockstep_e2e.cluster import Component, LocalCluster, free_port
from lockstep_e2e.collector import Collector, running_collector
from lockstep_e2e.install import install, start_operator
from lockstep_e2e.jobs import announce_weights, create_job, get_job, phase, rljob
from lockstep_e2e.lws import start_lws


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path_factory.mktemp("cluster")) as local:
        yield local
    _, alive = psutil.wait_procs([psutil.Process(pid) for pid in local.pids() if psutil.pid_exists(pid)], timeout=30)
    assert not alive, f"control-plane processes left behind: {[p.pid for p in alive]}"


@pytest.fixture(scope="session")
def kube(cluster: LocalCluster) -> Iterator[client.ApiClient]:
    """An admin API client for the session's cluster."""
    with cluster.api_client() as api:
        yield api


@pytest.fixture
def namespace(kube: client.ApiClient, request: pytest.FixtureRequest) -> Iterator[str]:
    """A new namespace named after the test, ready for pods (its default service account exists)."""
    with fresh_namespace(kube, request.node.name) as name:
        yield name


@contextmanager
def fresh_namespace(api: client.ApiClient, hint: str) -> Iterator[str]:
    """A new namespace named after ``hint``, ready for pods, deleted when the block ends."""
    slug = re.sub(r"[^a-z0-9]+", "-", hint.lower()).strip("-")[:40].rstrip("-")
    name = f"{slug}-{uuid.uuid4().hex[:6]}"
    core = client.CoreV1Api(api)
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    wait_for(
        lambda: bool(core.list_namespaced_service_account(name, field_selector="metadata.name=default").items),
        f"the default service account in namespace {name}",
    )
    try:
        yield name
    finally:
        core.delete_namespace(name)


def wait_for(condition: Callable[[], object], what: str, timeout: float = 60.0, interval: float = 0.2) -> None:
    """Poll ``condition()`` until it is truthy; fail the test naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")


@pytest.fixture(scope="session")
def operator_metrics_port() -> int:
    """Where the session's operator serves its Prometheus metrics."""
    return free_port()


@pytest.fixture(scope="session")
def collector(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Collector]:
    """A real OpenTelemetry Collector that the session's operator, and through it every trainer, sends traces to."""
    with running_collector(tmp_path_factory.mktemp("otelcol")) as running:
        yield running


@pytest.fixture(scope="session")
def lockstep(
    cluster: LocalCluster,
    kube: client.ApiClient,
    tmp_path_factory: pytest.TempPathFactory,
    operator_metrics_port: int,
    collector: Collector,
) -> Iterator[Component]:
    """Lockstep installed (CRDs, admission policies, default ParityPolicy) and its operator running, exporting its
    traces to ``collector`` as the chart's operator.tracing.otlpEndpoint sets it up, beside LeaderWorkerSet's
    controller (the chart's leaderWorkerSet.enabled: jobs whose actors are groups).

    Restarts wait 1 s (doubling) instead of 10 s, so restart tests stay short.
    """
    install(kube)
    workdir = tmp_path_factory.mktemp("operator")
    groups = start_lws(cluster, kube, workdir / "lws")
    flags = ("--restart-backoff-seconds=1", f"--metrics-port={operator_metrics_port}")
    values = (f"operator.tracing.otlpEndpoint={collector.endpoint}", "leaderWorkerSet.enabled=true")
    operator = start_operator(cluster, workdir / "operator.log", *flags, chart_values=values)
    yield operator
    operator.stop()
    groups.stop()


def running_job(kube: client.ApiClient, namespace: str, name: str, actors: int, **spec: Any) -> list[str]:
    """Create an RLJob (``spec``: further fields, as ``rljob`` takes them) and wait until it runs; its actor pod
    names."""
    create_job(kube, namespace, rljob(name, actors=actors, **spec))
    wait_for(lambda: phase(get_job(kube, namespace, name)) == "Running", f"RLJob {name} to run")
    return [f"{name}-actor-{i}" for i in range(actors)]


def weights_version(kube: client.ApiClient, namespace: str, name: str) -> int | None:
    version = get_job(kube, namespace, name)["status"].get("weightsVersion")
    return None if version is None else int(version)


def push_weights(kube: client.ApiClient, namespace: str, name: str, actors: list[str], version: int) -> None:
    """Announce weights ``version`` as the trainer and let agents on ``actors`` carry the barrier through."""
    with running_agents(kube, namespace, actors):
        announce_weights(kube, namespace, name, version)
        wait_for(lambda: weights_version(kube, namespace, name) == version, f"weights version {version}")
