"""Issue 46 items 1 and 2: a job's children are what the operator made, or what LeaderWorkerSet's controller made
from the job's own LeaderWorkerSet, told by the owner chain; anything else wearing the job's labels is a taken
name, never a member; a LeaderWorkerSet the job did not make is never adopted, and one someone else edited is
replaced."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_actor_groups import group_pods, grouped_job, running_groups

from factories import NOW, group_set_owners, job, owned, owner_reference, policy, stateful_set
from lockstep import desired, keys
from lockstep.conditions import READY, find
from lockstep.reconcile import Observed, reconcile
from lockstep.reconcile.ownership import Owners, is_child
from reconcile_helpers import announce, condition, settle, status_of

JOB = desired.JobRef("demo", "team-a", "uid-1")


def squatting(pod: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``pod`` (the job's labels, LeaderWorkerSet's label, the fingerprint) as a namespace user's StatefulSet
    <job>-actor makes it: the pod and the StatefulSet, which nobody owns."""
    pod = copy.deepcopy(pod)
    pod["metadata"]["labels"][keys.GROUP_SET_NAME] = "demo-actor"
    pod["metadata"]["uid"] = f"uid-squatting-{pod['metadata']['name']}"
    return owned(pod, owner_reference("StatefulSet", "demo-actor", "uid-squat", "apps/v1")), stateful_set(
        "demo-actor", "uid-squat"
    )


def test_what_the_operator_made_is_a_child_and_a_pod_owned_by_another_job_or_by_no_one_is_not() -> None:
    _, pods = settle(job())
    owners = Owners({})
    assert all(is_child(pod, JOB, owners, {}) for pod in pods)
    pod = pods[0]
    other_job = owned(pod, owner_reference("RLJob", "demo", "uid-other", "lockstep.dev/v1alpha1"))
    not_controller = owned(pod, owner_reference("RLJob", "demo", "uid-1", "lockstep.dev/v1alpha1", controller=False))
    nobody = owned(pod)
    assert not any(is_child(p, JOB, owners, {}) for p in (other_job, not_controller, nobody))


def test_leader_worker_sets_pods_of_the_jobs_own_set_are_children() -> None:
    body = grouped_job()
    pods, owners = group_set_owners(body, group_pods(body))
    by_uid = {pod["metadata"]["uid"]: pod for pod in pods}
    assert {p["metadata"]["labels"][keys.ROLE] for p in pods} == {keys.ACTOR, keys.ACTOR_WORKER}
    assert all(is_child(pod, JOB, Owners(owners), by_uid) for pod in pods)


LINKS = ["uid-lws", "uid-sts"]


@given(
    st.sampled_from(LINKS),
    st.sampled_from(["controller", "uid", "kind", "name", "gone", "owner job"]),
)
def test_any_broken_link_of_the_owner_chain_makes_the_groups_pods_not_children(link: str, breakage: str) -> None:
    """Property: each link must be controller: true, name the owner's kind, name and UID, and the owner must have
    been read; the set's controller must be this RLJob."""
    body = grouped_job()
    pods, owners = group_set_owners(body, group_pods(body))
    by_uid = {pod["metadata"]["uid"]: pod for pod in pods}
    owners = copy.deepcopy(owners)
    if breakage == "gone":
        del owners[link]
    else:
        ref = owners[link]["metadata"]["ownerReferences"][0]
        if breakage == "owner job":
            ref["uid"] = "uid-other" if link == "uid-lws" else ref["uid"]
            ref["name"] = ref["name"] if link == "uid-lws" else "other-actor"
        elif breakage == "controller":
            ref["controller"] = False
        elif breakage == "uid":
            ref["uid"] += "-x"
        elif breakage == "kind":
            ref["kind"] = "Deployment"
        else:
            ref["name"] += "-x"
    leaders = [pod for pod in pods if pod["metadata"]["labels"][keys.ROLE] == keys.ACTOR]
    assert not any(is_child(pod, JOB, Owners(owners), by_uid) for pod in leaders)
    assert not any(is_child(pod, JOB, Owners(owners), by_uid) for pod in pods)


def test_a_worker_whose_statefulset_is_owned_by_a_pod_that_is_not_a_leader_of_the_set_is_not_a_child() -> None:
    body = grouped_job()
    pods, owners = group_set_owners(body, group_pods(body))
    leader = next(pod for pod in pods if pod["metadata"]["name"] == "demo-actor-0")
    stray_leader, squat_set = squatting(leader)
    stray_leader["metadata"]["uid"] = "uid-stray"
    by_uid = {pod["metadata"]["uid"]: pod for pod in pods if pod["metadata"]["name"] != "demo-actor-0"}
    by_uid["uid-stray"] = stray_leader
    owners = {**owners, "uid-squat": squat_set}
    owners["uid-sts-demo-actor-0"]["metadata"]["ownerReferences"][0]["uid"] = "uid-stray"
    worker = next(pod for pod in pods if pod["metadata"]["name"] == "demo-actor-0-1")
    assert not is_child(worker, JOB, Owners(owners), by_uid)


def test_a_squatting_statefulsets_pod_is_a_taken_name_never_a_member_never_written_to() -> None:
    """The issue's reproduction: <job>-actor-1 is gone, and a StatefulSet named <job>-actor with ordinals.start 1
    makes a pod of that name with the job's labels, LeaderWorkerSet's label and the fingerprint; then the trainer
    announces a version."""
    body, pods = settle(job())
    squatter, squat_set = squatting(next(p for p in pods if p["metadata"]["name"] == "demo-actor-1"))
    squatter["metadata"]["managedFields"] = [{"manager": "kube-controller-manager"}]
    trainer = next(p for p in pods if p["metadata"]["name"] == "demo-trainer-0")
    announce(trainer, 1)
    rest = [p for p in pods if p["metadata"]["name"] != "demo-actor-1"]
    plan = reconcile(Observed(body, [*rest, squatter], [policy()], {}, NOW, owners={"uid-squat": squat_set}))
    assert condition(plan, READY) == ("False", "PodNameTaken")
    message = find(plan.status.conditions, READY).message  # type: ignore[union-attr]
    assert "pod demo-actor-1 wears this RLJob's labels but is not its own" in message
    assert "owned by StatefulSet demo-actor (uid uid-squat), owned by nobody" in message
    assert "written by kube-controller-manager" in message
    assert "demo-actor-1" not in plan.annotate_pods, "no barrier command reaches a pod the job did not make"
    assert "demo-actor-1" not in plan.delete_pods, "the operator never deletes what it does not own"
    assert not plan.create_pods
    assert plan.status.barrier is None or "demo-actor-1" not in json.dumps(status_of(plan)["barrier"])


def test_a_squatter_never_acks_a_barrier_and_the_open_barrier_goes_on_without_it() -> None:
    """A barrier open on the real actors: the squatter's ack (its token may write its own pod) counts for nothing."""
    body, pods = settle(job())
    trainer = next(p for p in pods if p["metadata"]["name"] == "demo-trainer-0")
    announce(trainer, 1)
    opened = reconcile(Observed(body, pods, [policy()], {}, NOW))
    command = json.loads(opened.annotate_pods["demo-actor-1"][keys.BARRIER])
    body = {**body, "status": status_of(opened)}
    squatter, squat_set = squatting(next(p for p in pods if p["metadata"]["name"] == "demo-actor-1"))
    ack = {"protocol": command["protocol"], "id": command["id"], "phase": "Updated", "loadedVersion": 1}
    squatter["metadata"]["annotations"][keys.BARRIER] = opened.annotate_pods["demo-actor-1"][keys.BARRIER]
    squatter["metadata"]["annotations"][keys.BARRIER_ACK] = json.dumps(ack)
    actor0 = next(p for p in pods if p["metadata"]["name"] == "demo-actor-0")
    actor0["metadata"]["annotations"][keys.BARRIER] = opened.annotate_pods["demo-actor-0"][keys.BARRIER]
    actor0["metadata"]["annotations"][keys.BARRIER_ACK] = json.dumps({**ack, "id": command["id"]})
    rest = [p for p in pods if p["metadata"]["name"] != "demo-actor-1"]
    plan = reconcile(Observed(body, [*rest, squatter], [policy()], {}, NOW, owners={"uid-squat": squat_set}))
    barrier = status_of(plan)["barrier"]
    assert squatter["metadata"]["uid"] not in barrier["members"].values(), "never a member"
    assert "demo-actor-1" not in (plan.waiting_for or set()), "never waited on"
    assert "demo-actor-1" not in plan.annotate_pods and "demo-actor-1" not in plan.delete_pods


def test_a_leader_worker_set_of_the_jobs_name_that_it_did_not_make_is_never_adopted() -> None:
    premade = {
        "kind": "LeaderWorkerSet",
        "metadata": {
            "name": "demo-actor",
            "uid": "uid-premade",
            "managedFields": [{"manager": "kubectl-client-side-apply"}],
        },
    }
    plan = reconcile(Observed(grouped_job(), [], [policy()], {}, NOW, group_set=premade))
    assert not [child for child in plan.children if child["kind"] == "LeaderWorkerSet"], "never applied over it"
    assert ("LeaderWorkerSet", "demo-actor") not in plan.remove_children, "and never deleted: it is not the job's"
    assert condition(plan, READY) == ("False", "PodNameTaken")
    message = find(plan.status.conditions, READY).message  # type: ignore[union-attr]
    assert "LeaderWorkerSet demo-actor was not made by this RLJob, which never adopts one: owned by nobody" in message
    assert "written by kubectl-client-side-apply" in message and "leaderworkerset demo-actor" in message


@pytest.mark.parametrize(
    ("manager", "operation", "replaced"),
    [
        ("kubectl-edit", "Update", True),
        ("kubectl", "Apply", True),
        (keys.FIELD_MANAGER, "Update", True),
        (keys.FIELD_MANAGER, "Apply", False),
    ],
)
def test_the_jobs_leader_worker_set_edited_by_anyone_else_is_replaced_whole(
    manager: str, operation: str, replaced: bool
) -> None:
    """Any field of the set's spec (a sidecar, an env variable, a hostPath), not only those the operator sets."""
    body, pods = running_groups()
    entries = [
        {"manager": keys.FIELD_MANAGER, "operation": "Apply", "fieldsV1": {"f:spec": {}}},
        {"manager": "lws", "operation": "Update", "subresource": "status", "fieldsV1": {"f:status": {}}},
        {"manager": manager, "operation": operation, "fieldsV1": {"f:spec": {"f:leaderWorkerTemplate": {}}}},
    ]
    ours = {
        "kind": "LeaderWorkerSet",
        "metadata": {
            "name": "demo-actor",
            "uid": "uid-lws",
            "ownerReferences": [owner_reference("RLJob", "demo", "uid-1", "lockstep.dev/v1alpha1")],
            "managedFields": entries,
        },
    }
    plan = reconcile(Observed(body, pods, [policy()], {}, NOW, group_set=ours))
    applied = [child for child in plan.children if child["kind"] == "LeaderWorkerSet"]
    if replaced:
        assert ("LeaderWorkerSet", "demo-actor") in plan.remove_children and not applied
        parity = find(plan.status.conditions, "ParityLocked")
        assert parity is not None and parity.status.value == "False" and parity.reason == "Drift"
        assert f"{manager} ({operation})" in parity.message
    else:
        assert ("LeaderWorkerSet", "demo-actor") not in plan.remove_children and applied


def test_a_pod_whose_statefulset_is_gone_is_left_to_the_garbage_collector_unreported() -> None:
    """LeaderWorkerSet makes a group's StatefulSet anew: the old one's pods, until the garbage collector deletes them,
    name a StatefulSet that is no longer there; they are no members, and no taken names either."""
    body, pods = running_groups()
    worker = next(p for p in pods if p["metadata"]["labels"][keys.ROLE] == keys.ACTOR_WORKER)
    orphan = owned(worker, owner_reference("StatefulSet", "demo-actor-0", "uid-gone", "apps/v1"))
    rest = [p for p in pods if p is not worker]
    plan = reconcile(Observed(body, [*rest, orphan], [policy()], {}, NOW))
    assert find(plan.status.conditions, READY) is None or condition(plan, READY)[1] != "PodNameTaken"
    assert worker["metadata"]["name"] not in plan.annotate_pods
