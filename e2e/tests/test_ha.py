"""Two operator replicas with leader election on the real control plane: one acts, the other stands by
(answering its liveness probe) and takes over an open barrier when the leader is killed; a leader that
cannot renew its Lease, or finds another holder in it, exits before anyone else could act beside it."""

from __future__ import annotations

import base64
import datetime as dt
import json
import re
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import urllib3
import yaml
from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

from lockstep import keys, leader
from lockstep_e2e.agents import running_agents
from lockstep_e2e.cluster import Component, LocalCluster
from lockstep_e2e.fixtures import fresh_namespace, running_job, wait_for, weights_version
from lockstep_e2e.install import apply, chart_rbac, install, start_operator
from lockstep_e2e.jobs import announce_weights, get_job

pytestmark = pytest.mark.cluster

# The requirement: after a kill -9 of the leader, the open barrier completes within 15 s.
TAKEOVER_LIMIT_SECONDS = 15.0
# The test's own share of the measured time: it polls the job every 0.2 s, and each poll is a read.
POLL_SLACK_SECONDS = 0.5
CREDENTIAL_ID = "authentication.kubernetes.io/credential-id"


@pytest.fixture(scope="module")
def ha_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A cluster of its own: the session's operator runs without leader election and would act beside these."""
    with LocalCluster(tmp_path_factory.mktemp("ha-cluster")) as local:
        with local.api_client() as api:
            install(api)
        yield local


@pytest.fixture
def api(ha_cluster: LocalCluster) -> Iterator[client.ApiClient]:
    with ha_cluster.api_client() as api:
        yield api


@pytest.fixture
def namespace(api: client.ApiClient, request: pytest.FixtureRequest) -> Iterator[str]:
    with fresh_namespace(api, request.node.name) as name:
        yield name


def start_replica(cluster: LocalCluster, log: Path) -> Component:
    return start_operator(cluster, log, "--leader-election", "--restart-backoff-seconds=1")


def lease(api: client.ApiClient) -> dict[str, Any]:
    return dict(
        json.loads(
            client.CoordinationV1Api(api)
            .read_namespaced_lease(leader.LEASE_NAME, keys.OPERATOR_NAMESPACE, _preload_content=False)
            .data
        )
    )


def holder(api: client.ApiClient) -> str | None:
    try:
        return lease(api)["spec"].get("holderIdentity")
    except ApiException as error:
        if error.status == 404:
            return None
        raise


def identity(replica: Component) -> str:
    """The replica's holder identity, as it logs it when it starts."""
    found = re.search(r"leader election: this replica is (\S+);", replica.log_path.read_text())
    assert found, replica.log_tail()
    return found.group(1)


def credential(replica: Component) -> str:
    """What the audit log records as the replica's credential: the JTI of its service account token."""
    assert replica.env is not None
    kubeconfig = yaml.safe_load(Path(replica.env["KUBECONFIG"]).read_text())
    payload = kubeconfig["users"][0]["user"]["token"].split(".")[1]
    claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    return f"JTI={claims['jti']}"


@pytest.fixture
def replicas(ha_cluster: LocalCluster, api: client.ApiClient, tmp_path: Path) -> Iterator[list[Component]]:
    """Two replicas; the first is the leader once the second starts."""
    started: list[Component] = []
    try:
        started.append(start_replica(ha_cluster, tmp_path / "operator-first.log"))
        wait_for(lambda: holder(api) == identity(started[0]), "the first replica to take the Lease")
        started.append(start_replica(ha_cluster, tmp_path / "operator-second.log"))
        yield started
    finally:
        for replica in started:
            replica.stop()


class CommandLog:
    """Every distinct ``lockstep.dev/barrier`` document each pod of the namespace carried, from a watch."""

    def __init__(self, api: client.ApiClient, namespace: str) -> None:
        self.api, self.namespace = api, namespace
        self.seen: dict[tuple[str, str, str], set[str]] = defaultdict(set)  # (pod, command id, phase) -> documents
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="command-log", daemon=True)

    def __enter__(self) -> CommandLog:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        core = client.CoreV1Api(self.api)
        listed = core.list_namespaced_pod(self.namespace)
        for pod in listed.items:
            self._record(pod)
        version = listed.metadata.resource_version
        while not self._stop.is_set():
            stream = watch.Watch()
            try:
                for event in stream.stream(
                    core.list_namespaced_pod, self.namespace, resource_version=version, timeout_seconds=1
                ):
                    self._record(event["object"])
                    version = event["object"].metadata.resource_version
            except (ApiException, urllib3.exceptions.HTTPError):
                continue  # reconnect from the last version seen

    def _record(self, pod: client.V1Pod) -> None:
        text = (pod.metadata.annotations or {}).get(keys.BARRIER)
        if text:
            command = json.loads(text)
            self.seen[(pod.metadata.name, command["id"], command["phase"])].add(text)


def test_standby_takes_over_a_killed_leader_and_finishes_its_barrier(
    ha_cluster: LocalCluster, api: client.ApiClient, namespace: str, replicas: list[Component]
) -> None:
    first, second = replicas
    transitions = lease(api)["spec"]["leaseTransitions"]
    assert f"standing by: {identity(first)} holds the Lease" in second.log_path.read_text()

    actors = running_job(api, namespace, "ha", 2)
    with CommandLog(api, namespace) as commands, running_agents(api, namespace, actors) as engines:
        engines[actors[1]].gates["swap"].clear()  # actor 1 is slow to swap: the barrier stays open in Update
        announce_weights(api, namespace, "ha", 1)
        wait_for(
            lambda: (get_job(api, namespace, "ha")["status"].get("barrier") or {}).get("phase") == "Update",
            "the barrier to reach Update",
        )
        assert first.process is not None
        first.process.kill()
        killed, killed_at = time.monotonic(), dt.datetime.now(dt.UTC)
        first.process.wait()
        engines[actors[1]].gates["swap"].set()  # it acks while no replica leads

        def finished() -> bool:
            return weights_version(api, namespace, "ha") == 1 and all(
                engine.calls == ["stage 1", "pause", "swap 1", "resume"] for engine in engines.values()
            )

        wait_for(finished, "the standby to take over and finish the barrier", timeout=60, interval=0.2)
        took = time.monotonic() - killed
    print(f"\ntakeover: the leader killed -> the barrier completed by the standby in {took:.1f}s")
    assert took < TAKEOVER_LIMIT_SECONDS + POLL_SLACK_SECONDS, f"the takeover took {took:.1f}s"

    # Exactly one Lease transition, to the standby.
    assert holder(api) == identity(second)
    assert lease(api)["spec"]["leaseTransitions"] == transitions + 1
    # No command was written twice with different contents, across the takeover.
    assert commands.seen, "the watch saw no barrier command"
    rewritten = {key: sorted(texts) for key, texts in commands.seen.items() if len(texts) > 1}
    assert rewritten == {}, "a command was written twice with different contents"
    assert {phase for _, _, phase in commands.seen} == {"Update", "Resume"}
    # Until the kill, the standby only read the Lease: it did not reconcile, watch or write anything.
    standby = credential(second)
    before_kill = {
        (event["verb"], event["objectRef"]["resource"])
        for event in ha_cluster.audit_events()
        if event.get("user", {}).get("extra", {}).get(CREDENTIAL_ID) == [standby]
        and dt.datetime.fromisoformat(event["requestReceivedTimestamp"]) < killed_at
    }
    assert before_kill == {("get", "leases")}
    # Stopped cleanly, the new leader hands the Lease back for the next replica.
    second.stop()
    assert second.process is not None and second.process.returncode == 0, second.log_tail()
    assert lease(api)["spec"].get("holderIdentity") is None


def test_a_leader_that_cannot_renew_exits_before_its_lease_could_expire(
    ha_cluster: LocalCluster, api: client.ApiClient, tmp_path: Path
) -> None:
    replica = start_replica(ha_cluster, tmp_path / "operator.log")
    rbac = client.RbacAuthorizationV1Api(api)
    try:
        wait_for(lambda: holder(api) == identity(replica), "the replica to take the Lease")
        # The API server now refuses its renewals (403), as it would refuse a partitioned replica's.
        rbac.delete_namespaced_role_binding("lockstep-operator-leader-election", keys.OPERATOR_NAMESPACE)
        assert replica.process is not None
        wait_for(lambda: replica.process is not None and replica.process.poll() is not None, "the leader to exit", 30)
        exited_at = dt.datetime.now(dt.UTC)
    finally:
        replica.stop()
        apply(api, list(chart_rbac()))
    assert replica.process.returncode == leader.EXIT_STATUS
    log = replica.log_path.read_text()
    lease_name = f"{keys.OPERATOR_NAMESPACE}/{leader.LEASE_NAME}"
    assert f"could not renew the Lease {lease_name} within {leader.RENEW_DEADLINE:.0f} s; exiting now" in log
    # Safety: it was gone before a standby could have seen its last renewal expire.
    spec = lease(api)["spec"]
    expires = dt.datetime.fromisoformat(spec["renewTime"]) + dt.timedelta(seconds=spec["leaseDurationSeconds"])
    assert exited_at < expires, f"exited at {exited_at}, its Lease could be taken from {expires}"


def test_a_leader_that_finds_another_holder_exits_at_once(
    ha_cluster: LocalCluster, api: client.ApiClient, tmp_path: Path
) -> None:
    replica = start_replica(ha_cluster, tmp_path / "operator.log")
    try:
        wait_for(lambda: holder(api) == identity(replica), "the replica to take the Lease")
        # Someone else writes itself into the Lease (a replica that wrongly thought it expired, say).
        client.CoordinationV1Api(api).patch_namespaced_lease(
            leader.LEASE_NAME, keys.OPERATOR_NAMESPACE, {"spec": {"holderIdentity": "intruder"}}
        )
        wait_for(lambda: replica.process is not None and replica.process.poll() is not None, "the leader to exit", 30)
    finally:
        replica.stop()
    assert replica.process is not None and replica.process.returncode == leader.EXIT_STATUS
    assert f"lost the Lease {keys.OPERATOR_NAMESPACE}/{leader.LEASE_NAME}: intruder holds it now" in (
        replica.log_path.read_text()
    )
    assert holder(api) == "intruder", "the leader that lost the Lease wrote it back"
