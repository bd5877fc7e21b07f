"""An RLJob as one Kueue Workload: what the reconciler does with what Kueue decided (lockstep.kueue)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from factories import NOW, job, policy, running
from lockstep import keys, kueue
from lockstep.api import Phase
from lockstep.conditions import QUEUED, READY, find
from lockstep.protocol import PROTOCOL
from lockstep.reconcile import KueueView, Observed, Plan, reconcile

FLAVOR = {
    "nodeLabels": {"cloud.example.com/accelerator": "h200"},
    "tolerations": [{"key": "gpu", "operator": "Exists"}],
}
REQUESTS = {"requests": {"cpu": "2", "memory": "4Gi"}}


def queued(**spec: Any) -> dict[str, Any]:
    body = job(**spec)
    body["spec"]["actors"]["resources"] = REQUESTS
    body["metadata"]["labels"] = {kueue.QUEUE_LABEL: "team-queue"}
    return body


def plan_for(body: dict[str, Any], view: KueueView | None, pods: list[dict[str, Any]] | None = None) -> Plan:
    return reconcile(Observed(body, pods or [], [policy()], {}, NOW, kueue=view))


def status(plan: Plan) -> dict[str, Any]:
    return plan.status.model_dump(mode="json", by_alias=True, exclude_none=True)


def the_workload(plan: Plan) -> dict[str, Any]:
    (found,) = [c for c in plan.children if c["kind"] == kueue.WORKLOAD]
    return found


def condition(conditions: list[dict[str, Any]], type_: str, status: str, reason: str = "", message: str = "") -> None:
    conditions.append({"type": type_, "status": status, "reason": reason, "message": message})


def kueue_says(workload: dict[str, Any], *, admitted: bool = False, evicted: str | None = None) -> dict[str, Any]:
    """``workload`` as Kueue left it: admitted to flavor 'h200' (every resource of every pod set), or evicted
    with that reason while it still holds its quota, or waiting for quota."""
    conditions: list[dict[str, Any]] = []
    metadata = {**workload["metadata"], "uid": "uid-w", "resourceVersion": "7", "generation": 1}
    body: dict[str, Any] = {**workload, "metadata": metadata}
    if admitted or evicted:
        condition(conditions, kueue.QUOTA_RESERVED, "True", "QuotaReserved")
        condition(conditions, kueue.ADMITTED, "True", "Admitted")
        assignments = [
            {"name": s["name"], "flavors": {"cpu": "h200", "memory": "h200"}} for s in workload["spec"]["podSets"]
        ]
        body["status"] = {"admission": {"clusterQueue": "gpus", "podSetAssignments": assignments}}
    else:
        condition(conditions, kueue.QUOTA_RESERVED, "False", "Pending", "insufficient unused quota for cpu in h200")
        body["status"] = {}
    if evicted:
        condition(conditions, kueue.EVICTED, "True", evicted, "Preempted to accommodate a higher priority Workload")
    body["status"]["conditions"] = conditions
    return body


def view_of(workload: dict[str, Any] | None) -> KueueView:
    return KueueView([workload] if workload else [], kueue.Flavors({"h200": FLAVOR}))


def test_a_queued_job_gets_one_workload_and_no_pods_until_admitted() -> None:
    plan = plan_for(queued(preflight={"enabled": True}), view_of(None))
    workload = the_workload(plan)
    assert not plan.create_pods
    assert plan.status.phase is Phase.QUEUED
    assert workload["spec"]["queueName"] == "team-queue" and workload["spec"]["active"] is True
    sets = {s["name"]: s for s in workload["spec"]["podSets"]}
    assert {name: s["count"] for name, s in sets.items()} == {keys.ACTOR: 2, keys.TRAINER: 1, keys.PREFLIGHT_ROLE: 1}
    assert sets[keys.ACTOR]["template"]["spec"]["containers"][0]["resources"] == REQUESTS
    assert workload["metadata"]["ownerReferences"][0]["kind"] == "RLJob"

    waiting = plan_for(queued(preflight={"enabled": True}), view_of(kueue_says(workload)))
    assert not waiting.create_pods
    found = find(waiting.status.conditions, QUEUED)
    assert found is not None and (found.status.value, found.reason) == ("True", "Pending")
    assert "LocalQueue team-queue" in found.message and "insufficient unused quota" in found.message
    ready = find(waiting.status.conditions, READY)
    assert ready is not None and ready.reason == "Queued"
    assert status(waiting)["queue"] == {"localQueue": "team-queue", "workload": workload["metadata"]["name"]}


def test_an_admitted_job_runs_its_pods_on_the_admitted_flavor() -> None:
    body = queued()
    workload = kueue_says(the_workload(plan_for(body, view_of(None))), admitted=True)
    plan = plan_for(body, view_of(workload))
    assert len(plan.create_pods) == 3
    assert the_workload(plan)["metadata"]["uid"] == "uid-w", "applied only onto the Workload the pass read"
    for pod in plan.create_pods:
        assert pod["spec"]["nodeSelector"] == FLAVOR["nodeLabels"]
        assert pod["spec"]["tolerations"] == FLAVOR["tolerations"]
    assert status(plan)["queue"]["clusterQueue"] == "gpus"
    found = find(plan.status.conditions, QUEUED)
    assert found is not None and (found.status.value, found.reason) == ("False", "Admitted")


def test_an_evicted_job_stops_its_pods_keeps_its_status_and_then_hands_the_quota_back() -> None:
    body = queued()
    admitted = kueue_says(the_workload(plan_for(body, view_of(None))), admitted=True)
    first = plan_for(body, view_of(admitted))
    pods = [running(p) for p in first.create_pods]
    body["status"] = status(plan_for({**body, "status": status(first)}, view_of(admitted), pods))
    body["status"]["weightsVersion"] = 3
    assert body["status"]["phase"] == "Running"

    evicted = kueue_says(admitted, evicted="Preempted")
    stopping = plan_for(body, view_of(evicted), pods)
    assert set(stopping.delete_pods) == {p["metadata"]["name"] for p in pods}
    assert not stopping.workload_status, "the quota goes back only once the pods are gone"
    assert stopping.status.phase is Phase.QUEUED
    assert stopping.status.restarts == 0 and stopping.status.replacements == 0
    assert stopping.status.weights_version == 3

    gone = plan_for({**body, "status": status(stopping)}, view_of(evicted), [])
    patch = gone.workload_status[evicted["metadata"]["name"]]
    assert patch["metadata"] == {"resourceVersion": "7"}
    assert patch["status"]["admission"] is None
    conditions = {c["type"]: c for c in patch["status"]["conditions"]}
    assert conditions[kueue.QUOTA_RESERVED]["status"] == "False"
    assert conditions[kueue.ADMITTED]["status"] == "False"
    assert (conditions[kueue.REQUEUED]["status"], conditions[kueue.REQUEUED]["reason"]) == ("True", "Preempted")
    assert conditions[kueue.EVICTED]["status"] == "True", "Kueue's own conditions are kept"
    assert gone.status.restarts == 0


def test_a_finished_job_marks_its_workload_finished_once() -> None:
    body = queued()
    admitted = kueue_says(the_workload(plan_for(body, view_of(None))), admitted=True)
    first = plan_for(body, view_of(admitted))
    pods = [running(p) for p in first.create_pods]
    pods[-1] = running(pods[-1], phase="Succeeded")  # trainer rank 0 completed, nothing announced
    done = plan_for({**body, "status": status(first)}, view_of(admitted), pods)
    assert done.status.phase is Phase.SUCCEEDED
    assert not done.workload_status, "its actors still run while they are deleted: the quota is still theirs"
    done = plan_for({**body, "status": status(done)}, view_of(admitted), pods[-1:])
    patch = done.workload_status[admitted["metadata"]["name"]]
    (finished,) = [c for c in patch["status"]["conditions"] if c["type"] == kueue.FINISHED]
    assert (finished["status"], finished["reason"]) == ("True", "Succeeded")

    told = {**admitted, "status": {**admitted["status"], "conditions": patch["status"]["conditions"]}}
    assert not plan_for({**body, "status": status(done)}, view_of(told)).workload_status


def test_suspending_a_queued_job_deactivates_its_workload() -> None:
    plan = plan_for(queued(suspend=True), view_of(None))
    assert the_workload(plan)["spec"]["active"] is False
    assert plan.status.phase is Phase.SUSPENDED


def test_other_pod_sets_make_another_workload_and_the_old_one_goes() -> None:
    body = queued()
    old = kueue_says(the_workload(plan_for(body, view_of(None))), admitted=True)
    body["spec"]["actors"]["replicas"] = 3
    plan = plan_for(body, view_of(old))
    assert the_workload(plan)["metadata"]["name"] != old["metadata"]["name"]
    assert (kueue.WORKLOAD, old["metadata"]["name"]) in plan.remove_children
    assert not plan.create_pods and plan.status.phase is Phase.QUEUED


def test_an_edit_kueue_does_not_count_keeps_the_admitted_workload() -> None:
    body = queued()
    admitted = kueue_says(the_workload(plan_for(body, view_of(None))), admitted=True)
    body["spec"]["actors"]["image"] = "lockstep/actor:v2"
    plan = plan_for(body, view_of(admitted))
    assert the_workload(plan)["metadata"]["name"] == admitted["metadata"]["name"]
    assert not plan.remove_children and len(plan.create_pods) == 3


def test_a_job_without_the_queue_label_runs_as_before_and_loses_a_workload_it_had() -> None:
    stale = {"metadata": {"name": "rljob-demo-old"}}
    plan = plan_for(job(), KueueView([stale]))
    assert len(plan.create_pods) == 3 and not any(c["kind"] == kueue.WORKLOAD for c in plan.children)
    assert (kueue.WORKLOAD, "rljob-demo-old") in plan.remove_children


def test_a_priority_class_gives_the_workload_its_priority_and_a_missing_one_holds_the_job() -> None:
    body = queued()
    body["metadata"]["labels"][kueue.PRIORITY_LABEL] = "urgent"
    missing = plan_for(body, view_of(None))
    found = find(missing.status.conditions, QUEUED)
    assert found is not None and found.reason == "PriorityClassNotFound" and "'urgent'" in found.message
    assert not missing.create_pods and not any(c["kind"] == kueue.WORKLOAD for c in missing.children)

    view = KueueView([], kueue.Flavors(), {"urgent": {"value": 1000}})
    spec = the_workload(plan_for(body, view))["spec"]
    assert spec["priority"] == 1000
    assert spec["priorityClassRef"] == {"group": kueue.GROUP, "kind": "WorkloadPriorityClass", "name": "urgent"}


@pytest.mark.parametrize(
    ("conditions", "expected"),
    [
        ([], kueue.Waiting("Pending", "Kueue has not considered the Workload yet")),
        ([("QuotaReserved", "True", "QuotaReserved"), ("Admitted", "False", "ChecksPending")], "ChecksPending"),
        ([("QuotaReserved", "False", "Pending"), ("Evicted", "True", "Preempted")], "Preempted"),
    ],
)
def test_what_a_workload_waits_for(conditions: list[tuple[str, str, str]], expected: object) -> None:
    body = {"status": {"conditions": [{"type": t, "status": s, "reason": r, "message": ""} for t, s, r in conditions]}}
    state = kueue.state(body)
    assert isinstance(state, kueue.Waiting)
    assert state == expected if isinstance(expected, kueue.Waiting) else state.reason == expected


def test_a_labelled_job_says_so_when_the_operators_kueue_integration_is_off() -> None:
    plan = plan_for(queued(), None)
    assert len(plan.create_pods) == 3
    found = find(plan.status.conditions, QUEUED)
    assert found is not None and (found.status.value, found.reason) == ("False", "KueueIntegrationOff")
    assert any(e.type == "Warning" and e.reason == "KueueIntegrationOff" for e in plan.events)


def admitted_and_running() -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
    """A queued job Kueue admitted, its pods running: the job, its Workload, its pods."""
    body = queued()
    admitted = kueue_says(the_workload(plan_for(body, view_of(None))), admitted=True)
    first = plan_for(body, view_of(admitted))
    pods = [running(p) for p in first.create_pods]
    body["status"] = status(plan_for({**body, "status": status(first)}, view_of(admitted), pods))
    assert body["status"]["phase"] == "Running"
    return body, admitted, pods


def test_an_evicted_job_hands_the_quota_back_only_once_no_pod_of_it_runs_terminating_ones_included() -> None:
    body, admitted, pods = admitted_and_running()
    evicted = kueue_says(admitted, evicted="Preempted")
    stopping = plan_for(body, view_of(evicted), pods)
    body["status"] = status(stopping)
    terminating = {**pods[0], "metadata": {**pods[0]["metadata"], "deletionTimestamp": "2026-11-29T12:00:00Z"}}
    held = plan_for(body, view_of(evicted), [terminating])
    assert not held.workload_status, "a pod shutting down still holds its devices, so the quota is Kueue's still"
    assert not held.delete_pods, "it is being deleted already"
    stopped = {**terminating, "status": {"phase": "Failed"}}
    assert evicted["metadata"]["name"] in plan_for(body, view_of(evicted), [stopped]).workload_status


def test_an_open_barrier_is_interrupted_when_kueue_evicts_the_job() -> None:
    body, admitted, pods = admitted_and_running()
    trainer = next(p for p in pods if p["metadata"]["labels"][keys.ROLE] == keys.TRAINER)
    trainer["metadata"]["annotations"][keys.WEIGHTS] = json.dumps(
        {"protocol": PROTOCOL, "version": 4, "uri": "file:///var/lib/lockstep/uid-1/weights/v4", "digest": "sha256:4"}
    )
    opened = plan_for(body, view_of(admitted), pods)
    assert opened.status.barrier is not None
    body["status"] = status(opened)
    evicted = plan_for(body, view_of(kueue_says(admitted, evicted="Preempted")), pods)
    assert evicted.status.barrier is None and evicted.status.phase is Phase.QUEUED
    assert [(r.version, r.outcome.value, r.reason) for r in evicted.status.barrier_history] == [
        (4, "Interrupted", "Preempted")
    ]
    assert any(e.reason == "WeightUpdateInterrupted" and "team-queue" in e.message for e in evicted.events)


def test_a_workload_deleted_while_admitted_is_created_again_said_and_counted_as_replacements() -> None:
    body, admitted, pods = admitted_and_running()
    name = admitted["metadata"]["name"]
    lost = plan_for(body, view_of(None), pods)
    assert the_workload(lost)["metadata"]["name"] == name, "created again"
    assert "uid" not in the_workload(lost)["metadata"], "not onto the one deleted"
    assert set(lost.delete_pods) == {p["metadata"]["name"] for p in pods}
    assert all(f"Workload {name} was deleted" in why for why in lost.delete_pods.values())
    assert lost.status.replacements == len(pods) and lost.status.restarts == 0
    found = find(lost.status.conditions, QUEUED)
    assert found is not None and (found.status.value, found.reason) == ("True", "WorkloadDeleted")
    (event,) = [e for e in lost.events if e.reason == "WorkloadDeleted"]
    assert event.type == "Warning" and f"Workload {name}, admitted to ClusterQueue gpus, was deleted" in event.message

    body["status"] = status(lost)
    waiting = plan_for(body, view_of(kueue_says(the_workload(lost))), [])
    assert waiting.status.replacements == len(pods), "counted once"
    assert not [e for e in waiting.events if e.reason == "WorkloadDeleted"]
