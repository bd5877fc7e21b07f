"""RLJobs queued, admitted as one gang, and preempted by Kueue's real controller manager (built from
sigs.k8s.io/kueue, lockstep_e2e.kueue), on a control plane of their own; the operator runs with --kueue and the RBAC
the chart grants with kueue.enabled=true (and leaderWorkerSet.enabled=true: LeaderWorkerSet runs there too, for a
job whose actors are groups)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from lockstep import desired, keys, kueue
from lockstep.kubeclient import KubeClient
from lockstep_e2e.cluster import LocalCluster
from lockstep_e2e.fixtures import fresh_namespace, push_weights, wait_for
from lockstep_e2e.install import install, start_operator
from lockstep_e2e.jobs import (
    announce_weights,
    condition,
    create_job,
    events_for,
    get_job,
    job_pods,
    patch_job,
    phase,
    rljob,
)
from lockstep_e2e.kueue import start_kueue
from lockstep_e2e.lws import start_lws

pytestmark = pytest.mark.cluster

FLAVOR_LABELS = {"type": "kwok"}
"""The flavor's node labels: every kwok node has them, so the admitted pods still schedule."""
FLAVOR_TOLERATION = {"key": "lockstep.dev/e2e-reserved", "operator": "Exists", "effect": "NoSchedule"}
POD_CPU = 1
"""Each pod of a job (2 actors and 1 trainer) requests one CPU: a queue with 3 CPUs holds one job."""


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[client.ApiClient]:
    """An admin client of a control plane with Lockstep installed, Kueue and LeaderWorkerSet running, and the
    operator run with --kueue; one ResourceFlavor."""
    workdir = tmp_path_factory.mktemp("kueue")
    with LocalCluster(workdir / "cluster") as cluster:
        api = cluster.api_client()
        install(api)
        controller = start_kueue(cluster, api, workdir / "kueue")
        groups = start_lws(cluster, api, workdir / "lws")
        operator = start_operator(
            cluster,
            workdir / "operator.log",
            "--kueue",
            "--restart-backoff-seconds=1",
            chart_values=("kueue.enabled=true", "leaderWorkerSet.enabled=true"),
        )
        flavor = {"nodeLabels": FLAVOR_LABELS, "tolerations": [FLAVOR_TOLERATION]}
        _create(api, "resourceflavors", {"metadata": {"name": "e2e-flavor"}, "spec": flavor})
        try:
            yield api
        finally:
            operator.stop()
            groups.stop()
            controller.stop()


@pytest.fixture
def namespace(kube: client.ApiClient, request: pytest.FixtureRequest) -> Iterator[str]:
    with fresh_namespace(kube, request.node.name) as name:
        yield name


def _create(api: client.ApiClient, plural: str, body: dict[str, Any], namespace: str | None = None) -> None:
    custom = client.CustomObjectsApi(api)
    body = {"apiVersion": kueue.API_VERSION, "kind": _KINDS[plural], **body}
    if namespace is None:
        custom.create_cluster_custom_object(kueue.GROUP, kueue.VERSION, plural, body)
    else:
        custom.create_namespaced_custom_object(kueue.GROUP, kueue.VERSION, namespace, plural, body)


_KINDS = {
    "resourceflavors": "ResourceFlavor",
    "clusterqueues": "ClusterQueue",
    "localqueues": "LocalQueue",
    "workloadpriorityclasses": "WorkloadPriorityClass",
}


def queue_for_one_job(kube: client.ApiClient, namespace: str) -> str:
    """A ClusterQueue with quota for one job (preempting lower priorities within it), and a LocalQueue for
    ``namespace``; the LocalQueue's name."""
    name = f"e2e-{uuid.uuid4().hex[:6]}"
    quota = [{"name": "cpu", "nominalQuota": 3 * POD_CPU}, {"name": "memory", "nominalQuota": "3Gi"}]
    spec = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
        "resourceGroups": [
            {"coveredResources": ["cpu", "memory"], "flavors": [{"name": "e2e-flavor", "resources": quota}]}
        ],
        "preemption": {"withinClusterQueue": "LowerPriority"},
    }
    _create(kube, "clusterqueues", {"metadata": {"name": name}, "spec": spec})
    _create(kube, "localqueues", {"metadata": {"name": name}, "spec": {"clusterQueue": name}}, namespace)
    return name


def queued_job(
    kube: client.ApiClient,
    namespace: str,
    name: str,
    queue: str,
    priority: str | None = None,
    group: dict[str, Any] | None = None,
) -> None:
    """A job of 3 pods that waits in ``queue``: 2 actors and a trainer, or with ``group`` 1 group and a trainer."""
    job = rljob(name, actors=1 if group else 2)
    if group:
        job["spec"]["actors"]["group"] = group
    resources = {"requests": {"cpu": str(POD_CPU), "memory": "1Gi"}}
    job["spec"]["actors"]["resources"] = resources
    job["spec"]["trainer"]["resources"] = resources
    job["metadata"]["labels"] = {kueue.QUEUE_LABEL: queue, **({kueue.PRIORITY_LABEL: priority} if priority else {})}
    create_job(kube, namespace, job)


def wait_phase(kube: client.ApiClient, namespace: str, name: str, wanted: str, timeout: float = 60) -> dict[str, Any]:
    wait_for(lambda: phase(get_job(kube, namespace, name)) == wanted, f"RLJob {name} to be {wanted}", timeout)
    return get_job(kube, namespace, name)


def complete(kube: client.ApiClient, namespace: str, name: str) -> None:
    """The trainer finishes (kwok leaves a Succeeded pod as it is); the job succeeds."""
    client.CoreV1Api(kube).patch_namespaced_pod_status(
        f"{name}-trainer-0", namespace, {"status": {"phase": "Succeeded"}}
    )
    wait_phase(kube, namespace, name, "Succeeded")


def workload(kube: client.ApiClient, namespace: str, job: str) -> dict[str, Any]:
    """The Workload the job's status names."""
    return workload_named(kube, namespace, get_job(kube, namespace, job)["status"]["queue"]["workload"])


def workload_named(kube: client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    found: dict[str, Any] = client.CustomObjectsApi(kube).get_namespaced_custom_object(
        kueue.GROUP, kueue.VERSION, namespace, kueue.WORKLOADS, name
    )
    return found


def priorities(kube: client.ApiClient, namespace: str) -> tuple[str, str]:
    """A low and a high WorkloadPriorityClass, named after ``namespace``."""
    low, high = f"low-{namespace}", f"high-{namespace}"
    for name, value in ((low, 10), (high, 1000)):
        _create(kube, "workloadpriorityclasses", {"metadata": {"name": name}, "value": value})
    return low, high


def conditions_of(workload: dict[str, Any]) -> dict[str, str]:
    return {c["type"]: c["status"] for c in (workload.get("status") or {}).get("conditions") or []}


def test_a_job_of_actor_groups_is_one_gang_and_kueue_preempts_its_groups_whole(
    kube: client.ApiClient, namespace: str
) -> None:
    """The job's one Workload counts its groups' pods beside its trainer (Lockstep's own gang, not Kueue's
    LeaderWorkerSet integration, which would admit each group apart from the trainer); a preemption deletes the
    LeaderWorkerSet, so no group is left half-running or recreated, and admission again brings the groups back."""
    queue = queue_for_one_job(kube, namespace)
    low, high = priorities(kube, namespace)
    queued_job(kube, namespace, "grouped", queue, priority=low, group={"pods": 2, "tensorParallelSize": 2})
    wait_phase(kube, namespace, "grouped", "Running", timeout=90)
    sets = {s["name"]: s["count"] for s in workload(kube, namespace, "grouped")["spec"]["podSets"]}
    assert sets == {keys.ACTOR: 1, keys.ACTOR_WORKER: 1, keys.TRAINER: 1}
    names = {"grouped-actor-0", "grouped-actor-0-1", "grouped-trainer-0"}
    assert {pod.metadata.name for pod in job_pods(kube, namespace, "grouped")} == names

    queued_job(kube, namespace, "urgent", queue, priority=high)
    assert condition(wait_phase(kube, namespace, "grouped", "Queued"), "Queued")["reason"] == "Preempted"
    wait_phase(kube, namespace, "urgent", "Running")
    wait_for(lambda: not job_pods(kube, namespace, "grouped"), "the preempted job's pods, its groups' too, to go")
    custom = client.CustomObjectsApi(kube)
    group, version = desired.LEADER_WORKER_SET_GROUP, desired.LEADER_WORKER_SET_VERSION
    left = custom.list_namespaced_custom_object(group, version, namespace, desired.LEADER_WORKER_SETS)
    assert left["items"] == [], "no LeaderWorkerSet recreates a preempted group"

    complete(kube, namespace, "urgent")
    wait_phase(kube, namespace, "grouped", "Running", timeout=90)
    assert {pod.metadata.name for pod in job_pods(kube, namespace, "grouped")} == names
    complete(kube, namespace, "grouped")


HOLD = "test.lockstep.dev/hold"
"""A finalizer that keeps a deleted pod Terminating, as a slow vLLM shutdown would (kwok stops nothing itself)."""


def test_jobs_wait_in_their_queue_for_quota_and_run_as_one_gang(kube: client.ApiClient, namespace: str) -> None:
    queue = queue_for_one_job(kube, namespace)
    queued_job(kube, namespace, "first", queue)
    first = wait_phase(kube, namespace, "first", "Running")
    assert first["status"]["queue"]["localQueue"] == queue
    assert first["status"]["queue"]["clusterQueue"] == queue
    assert condition(first, "Queued")["status"] == "False"
    assert condition(first, "Queued")["reason"] == "Admitted"
    pods = job_pods(kube, namespace, "first")
    assert len(pods) == 3
    for pod in pods:  # the admitted flavor's node labels and tolerations
        assert pod.spec.node_selector == FLAVOR_LABELS, pod.metadata.name
        assert any(t.key == FLAVOR_TOLERATION["key"] for t in pod.spec.tolerations or []), pod.metadata.name
    # One gang: a pod set per role, with the pods' real requests.
    sets = {s["name"]: s for s in workload(kube, namespace, "first")["spec"]["podSets"]}
    assert {name: s["count"] for name, s in sets.items()} == {keys.ACTOR: 2, keys.TRAINER: 1}
    requests = sets[keys.ACTOR]["template"]["spec"]["containers"][0]["resources"]["requests"]
    assert requests["cpu"] == str(POD_CPU)

    queued_job(kube, namespace, "second", queue)
    second = wait_phase(kube, namespace, "second", "Queued")
    waiting = condition(second, "Queued")
    assert waiting["status"] == "True"
    assert waiting["reason"], "Kueue's reason"
    assert f"waiting in LocalQueue {queue}" in waiting["message"]
    assert condition(second, "Ready")["reason"] == "Queued"
    assert not job_pods(kube, namespace, "second"), "a queued job holds no pods"

    complete(kube, namespace, "first")
    wait_for(  # once its pods are gone
        lambda: conditions_of(workload(kube, namespace, "first")).get(kueue.FINISHED) == "True",
        "the finished job's Workload to be Finished",
    )
    wait_phase(kube, namespace, "second", "Running")
    assert len(job_pods(kube, namespace, "second")) == 3


def test_a_higher_priority_job_preempts_and_the_preempted_one_resumes_from_its_weights(
    kube: client.ApiClient, namespace: str
) -> None:
    queue = queue_for_one_job(kube, namespace)
    low, high = priorities(kube, namespace)
    queued_job(kube, namespace, "background", queue, priority=low)
    wait_phase(kube, namespace, "background", "Running")
    assert workload(kube, namespace, "background")["spec"]["priority"] == 10
    push_weights(kube, namespace, "background", ["background-actor-0", "background-actor-1"], 1)
    before = get_job(kube, namespace, "background")["status"]

    queued_job(kube, namespace, "urgent", queue, priority=high)
    preempted = wait_phase(kube, namespace, "background", "Queued")
    assert condition(preempted, "Queued")["reason"] == "Preempted"
    wait_phase(kube, namespace, "urgent", "Running")
    wait_for(lambda: not job_pods(kube, namespace, "background"), "the preempted job's pods to be deleted")
    kept = get_job(kube, namespace, "background")["status"]
    assert kept["weightsVersion"] == 1, "the committed weights are kept"
    assert kept["restarts"] == 0, "a preemption is not a failure"
    assert kept["replacements"] == before["replacements"]

    complete(kube, namespace, "urgent")
    wait_phase(kube, namespace, "background", "Running")
    resumed = get_job(kube, namespace, "background")["status"]
    assert resumed["restarts"] == 0
    for pod in job_pods(kube, namespace, "background"):
        assert '"version":1' in pod.metadata.annotations[keys.INITIAL_WEIGHTS].replace(" ", ""), pod.metadata.name
    complete(kube, namespace, "background")


def test_an_evicted_jobs_quota_goes_back_only_once_its_terminating_pods_are_gone(
    kube: client.ApiClient, namespace: str
) -> None:
    queue = queue_for_one_job(kube, namespace)
    low, high = priorities(kube, namespace)
    queued_job(kube, namespace, "slow", queue, priority=low)
    wait_phase(kube, namespace, "slow", "Running")
    core = client.CoreV1Api(kube)
    core.patch_namespaced_pod("slow-actor-0", namespace, {"metadata": {"finalizers": [HOLD]}})

    queued_job(kube, namespace, "urgent", queue, priority=high)
    wait_phase(kube, namespace, "slow", "Queued")
    wait_for(
        lambda: (
            [(p.metadata.name, bool(p.metadata.deletion_timestamp)) for p in job_pods(kube, namespace, "slow")]
            == [("slow-actor-0", True)]
        ),
        "the evicted job's pods to be gone but the held one, Terminating",
    )
    # A spec edit the Workload does not carry: once the operator observed it, it has seen the held pod alone.
    edited = patch_job(kube, namespace, "slow", {"spec": {"ttlSecondsAfterFinished": 3600}})["metadata"]["generation"]
    wait_for(
        lambda: get_job(kube, namespace, "slow")["status"].get("observedGeneration") == edited,
        "the operator to observe the edit",
    )
    held = conditions_of(workload(kube, namespace, "slow"))
    assert held[kueue.QUOTA_RESERVED] == "True", "a pod still shutting down keeps the quota from the preemptor"
    assert not job_pods(kube, namespace, "urgent")

    core.patch_namespaced_pod("slow-actor-0", namespace, {"metadata": {"finalizers": None}})
    wait_phase(kube, namespace, "urgent", "Running")
    assert conditions_of(workload(kube, namespace, "slow"))[kueue.QUOTA_RESERVED] == "False"
    assert not job_pods(kube, namespace, "slow")


def test_a_barrier_open_when_kueue_preempts_the_job_closes_as_interrupted(
    kube: client.ApiClient, namespace: str
) -> None:
    queue = queue_for_one_job(kube, namespace)
    low, high = priorities(kube, namespace)
    queued_job(kube, namespace, "mid", queue, priority=low)
    wait_phase(kube, namespace, "mid", "Running")
    announce_weights(kube, namespace, "mid", 1)  # no agent acks: the barrier stays open
    wait_for(lambda: get_job(kube, namespace, "mid")["status"].get("barrier"), "the barrier to open")

    queued_job(kube, namespace, "urgent", queue, priority=high)
    preempted = wait_phase(kube, namespace, "mid", "Queued")
    assert "barrier" not in preempted["status"], "no barrier stays open while the job holds no pods"
    (record,) = preempted["status"]["barrierHistory"]
    assert (record["version"], record["outcome"], record["reason"]) == (1, "Interrupted", "Preempted")
    assert "weightsVersion" not in preempted["status"], "an interrupted barrier commits nothing"
    wait_for(
        lambda: any(
            e.reason == "WeightUpdateInterrupted" and e.type == "Warning" and f"LocalQueue {queue}" in e.message
            for e in events_for(kube, namespace, "mid")
        ),
        "the WeightUpdateInterrupted Event",
    )


def test_a_workload_deleted_by_hand_is_created_again_said_and_counted(kube: client.ApiClient, namespace: str) -> None:
    queue = queue_for_one_job(kube, namespace)
    queued_job(kube, namespace, "lost", queue)
    wait_phase(kube, namespace, "lost", "Running")
    name = workload(kube, namespace, "lost")["metadata"]["name"]
    client.CustomObjectsApi(kube).delete_namespaced_custom_object(
        kueue.GROUP, kueue.VERSION, namespace, kueue.WORKLOADS, name
    )
    wait_for(
        lambda: get_job(kube, namespace, "lost")["status"].get("replacements") == 3,
        "the gang's restart to be counted as 3 replacements",
    )
    wait_phase(kube, namespace, "lost", "Running")  # its Workload created again, and admitted
    said = [e for e in events_for(kube, namespace, "lost") if e.reason == "WorkloadDeleted"]
    assert said and said[0].type == "Warning" and f"Workload {name}" in said[0].message
    deleting = [e.message for e in events_for(kube, namespace, "lost") if e.reason == "DeletingPods"]
    assert any(f"Kueue Workload {name} was deleted" in m for m in deleting), deleting
    assert not any("Kueue has not admitted" in m for m in deleting), "not read as an eviction"
    status = get_job(kube, namespace, "lost")["status"]
    assert status["restarts"] == 0 and status["queue"]["workload"] == name


def test_a_person_suspends_a_queued_job_by_hand_and_its_quota_goes_to_the_next(
    kube: client.ApiClient, namespace: str
) -> None:
    queue = queue_for_one_job(kube, namespace)
    queued_job(kube, namespace, "paused", queue)
    wait_phase(kube, namespace, "paused", "Running")
    queued_job(kube, namespace, "next", queue)
    wait_phase(kube, namespace, "next", "Queued")

    patch_job(kube, namespace, "paused", {"spec": {"suspend": True}})
    suspended = wait_phase(kube, namespace, "paused", "Suspended")
    assert condition(suspended, "Ready")["reason"] == "Suspended"
    assert workload(kube, namespace, "paused")["spec"]["active"] is False
    wait_phase(kube, namespace, "next", "Running")
    assert not job_pods(kube, namespace, "paused")

    patch_job(kube, namespace, "paused", {"spec": {"suspend": False}})
    wait_phase(kube, namespace, "paused", "Queued")
    complete(kube, namespace, "next")
    wait_phase(kube, namespace, "paused", "Running")


def test_a_workload_applied_onto_one_since_deleted_is_not_created_again(kube: client.ApiClient, namespace: str) -> None:
    """What desired.onto relies on: a pass that read a Workload applies onto its uid, and once that Workload is
    deleted the API server refuses the apply (409) instead of creating it again without the pass's knowing."""
    pod_set = {"name": "main", "count": 1, "template": {"spec": {"containers": [{"name": "c", "image": "none"}]}}}
    body = {
        "apiVersion": kueue.API_VERSION,
        "kind": kueue.WORKLOAD,
        "metadata": {"name": "read-then-deleted", "namespace": namespace},
        "spec": {"queueName": "none", "podSets": [pod_set]},
    }
    writes = KubeClient(kube)
    writes.apply(body)
    read = workload_named(kube, namespace, "read-then-deleted")
    writes.delete_child(kueue.WORKLOAD, namespace, "read-then-deleted")
    with pytest.raises(ApiException) as refused:
        writes.apply(desired.onto(body, read))
    assert refused.value.status == 409, refused.value.body
    with pytest.raises(ApiException, match="Not Found"):
        workload_named(kube, namespace, "read-then-deleted")
