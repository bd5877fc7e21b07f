"""An RLJob whose actors are groups of two pods (spec.actors.group), with LeaderWorkerSet's real controller and
webhooks (lockstep_e2e.lws) beside the session's operator, which has the chart's RBAC for LeaderWorkerSets. Pods are
kwok's; the barrier's agents are the real PodAgent on recording engines, one per group leader, each with a token
bound to its pod (lockstep_e2e.agents)."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from lockstep import desired, keys
from lockstep.api import ActorGroup
from lockstep_e2e.agents import running_agents
from lockstep_e2e.fixtures import push_weights, wait_for, weights_version
from lockstep_e2e.install import apply
from lockstep_e2e.jobs import announce_weights, condition, create_job, events_for, get_job, rljob
from lockstep_workers.actor.group import node_of

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("lockstep")]

GROUP = {"pods": 2, "tensorParallelSize": 2}
LEADERS = ["big-actor-0", "big-actor-1"]
PODS = {"big-actor-0", "big-actor-0-1", "big-actor-1", "big-actor-1-1"}


def pods(kube: client.ApiClient, namespace: str) -> dict[str, Any]:
    listed = client.CoreV1Api(kube).list_namespaced_pod(namespace, label_selector=f"{keys.JOB}=big")
    return {pod.metadata.name: pod for pod in listed.items if pod.metadata.deletion_timestamp is None}


SETS = (desired.LEADER_WORKER_SET_GROUP, desired.LEADER_WORKER_SET_VERSION)


def group_set(kube: client.ApiClient, namespace: str, name: str) -> dict[str, Any] | None:
    """The LeaderWorkerSet ``name`` as read, or None while there is none."""
    try:
        found = client.CustomObjectsApi(kube).get_namespaced_custom_object(
            *SETS, namespace, desired.LEADER_WORKER_SETS, name
        )
    except ApiException as error:
        if error.status != 404:
            raise
        return None
    return dict(found)


def running_groups(kube: client.ApiClient, namespace: str) -> None:
    """Create the job of two groups and wait until it runs, every pod of its groups ready."""
    job = rljob("big", actors=2)
    job["spec"]["actors"]["group"] = GROUP
    create_job(kube, namespace, job)

    def runs() -> bool:
        status = get_job(kube, namespace, "big").get("status") or {}
        return status.get("phase") == "Running" and (status.get("actorPods") or {}).get("ready") == len(PODS)

    wait_for(runs, "RLJob big to run with its 2 groups of 2 pods", timeout=120)


def test_the_groups_run_as_a_leader_worker_set_and_update_as_one_member_each(
    kube: client.ApiClient, namespace: str
) -> None:
    """LeaderWorkerSet creates the groups' pods through Lockstep's admission policy (the StatefulSet controller may
    label them as Lockstep's); each pod learns its place from LeaderWorkerSet's webhook as lockstep_workers.actor.group
    reads it; the status counts groups and pods; a weight update is a barrier of the two leaders."""
    running_groups(kube, namespace)
    status = get_job(kube, namespace, "big")["status"]
    assert status["actors"]["summary"] == "2/2" and status["actorPods"]["summary"] == "4/4"
    assert set(pods(kube, namespace)) | {"big-trainer-0"} == PODS | {"big-trainer-0"}
    for name, pod in pods(kube, namespace).items():
        if name == "big-trainer-0":
            continue
        [container] = pod.spec.containers
        env = {variable.name: variable.value for variable in container.env if variable.value is not None}
        node = node_of(env, ActorGroup.model_validate(GROUP))
        leader = name in LEADERS
        assert node.rank == (0 if leader else 1), (name, env)
        assert node.leader.startswith(f"big-actor-{name.split('-')[2]}.big-actor.{namespace}"), node.leader
        assert pod.metadata.labels[keys.ROLE] == (keys.ACTOR if leader else keys.ACTOR_WORKER)
        assert container.command[-1] == ("lockstep_workers.actor" if leader else "lockstep_workers.actor.headless")

    push_weights(kube, namespace, "big", LEADERS, 1)
    [record] = get_job(kube, namespace, "big")["status"]["barrierHistory"]
    assert (record["version"], record["members"], record["outcome"]) == (1, 2, "Completed")


def test_a_worker_lost_mid_update_recreates_its_group_which_catches_up(kube: client.ApiClient, namespace: str) -> None:
    """A worker pod deleted while its leader swaps: LeaderWorkerSet recreates the whole group, the barrier finishes
    without it, and the new leader comes to the newest weights in a barrier of its own."""
    running_groups(kube, namespace)
    core = client.CoreV1Api(kube)
    lost = core.read_namespaced_pod("big-actor-1", namespace).metadata.uid
    with running_agents(kube, namespace, LEADERS) as engines:
        victim = engines["big-actor-1"]
        victim.gates["swap"].clear()
        announce_weights(kube, namespace, "big", 1)
        wait_for(lambda: victim.waiting == "swap", "group 1's leader to swap version 1")
        core.delete_namespaced_pod("big-actor-1-1", namespace)
        victim.kill()  # its group is recreated: the leader's process goes with it
        wait_for(lambda: weights_version(kube, namespace, "big") == 1, "the barrier to finish without group 1")
        assert engines["big-actor-0"].calls == ["stage 1", "pause", "swap 1", "resume"], "group 0 resumed"

    def recreated() -> bool:
        now = pods(kube, namespace)
        leader = now.get("big-actor-1")
        return set(now) >= PODS and leader is not None and leader.metadata.uid != lost

    wait_for(recreated, "LeaderWorkerSet to recreate group 1 whole", timeout=90)
    with running_agents(kube, namespace, ["big-actor-1"]) as late:
        expected = ["stage 1", "pause", "swap 1", "resume"]
        wait_for(lambda: late["big-actor-1"].calls == expected, "group 1's new leader to catch up to version 1")
        wait_for(lambda: "barrier" not in get_job(kube, namespace, "big")["status"], "no barrier open")
    history = get_job(kube, namespace, "big")["status"]["barrierHistory"]
    # (version, members that completed it): the update without group 1, then group 1's catch-up.
    assert [(r["version"], r["members"]) for r in history] == [(1, 1), (1, 1)]


def test_a_leader_worker_set_made_before_the_job_is_never_adopted(kube: client.ApiClient, namespace: str) -> None:
    """Issue 46 item 2: a namespace user makes the LeaderWorkerSet <job>-actor (a sidecar with LD_PRELOAD beside
    the engine) before the job exists, and LeaderWorkerSet's controller makes its pods, of the names the job's
    groups would have. The job names the set as a taken name and never adopts it: no owner reference, no write of
    the operator's, its spec as the user wrote it; its pods are never deleted, commanded or counted."""
    from test_hardening import name_taken

    containers = [
        {"name": "engine", "image": "busybox"},
        {"name": "sidecar", "image": "busybox", "env": [{"name": "LD_PRELOAD", "value": "/hooks/steal.so"}]},
    ]
    premade = {
        "apiVersion": "/".join(SETS),
        "kind": desired.LEADER_WORKER_SET,
        "metadata": {"name": "premade-actor"},
        "spec": {
            "replicas": 1,
            "leaderWorkerTemplate": {"size": 2, "workerTemplate": {"spec": {"containers": containers}}},
        },
    }
    made = client.CustomObjectsApi(kube).create_namespaced_custom_object(
        *SETS, namespace, desired.LEADER_WORKER_SETS, premade, field_manager="kubectl-create"
    )
    core = client.CoreV1Api(kube)
    its_pods = ["premade-actor-0", "premade-actor-0-1"]

    def made_pods() -> dict[str, str]:
        listed = core.list_namespaced_pod(namespace, label_selector="leaderworkerset.sigs.k8s.io/name=premade-actor")
        return {pod.metadata.name: pod.metadata.uid for pod in listed.items}

    wait_for(lambda: sorted(made_pods()) == its_pods, "LeaderWorkerSet's controller to make the user's group")
    uids = made_pods()
    job = rljob("premade", actors=1)
    job["spec"]["actors"]["group"] = GROUP
    create_job(kube, namespace, job)

    message = name_taken(kube, namespace, "premade")["message"]
    assert (
        "LeaderWorkerSet premade-actor was not made by this RLJob, which never adopts one: owned by nobody, "
        "written by kubectl-create" in message
    ), message
    assert f"kubectl delete -n {namespace} leaderworkerset premade-actor" in message, message
    found = group_set(kube, namespace, "premade-actor")
    assert found is not None and found["metadata"]["uid"] == made["metadata"]["uid"]
    assert not found["metadata"].get("ownerReferences"), "never adopted"
    managers = {entry["manager"] for entry in found["metadata"]["managedFields"]}
    assert keys.FIELD_MANAGER not in managers, managers
    assert found["spec"] == made["spec"], "its templates as the user wrote them"
    assert made_pods() == uids, "its pods never deleted"
    for name in its_pods:
        assert keys.BARRIER not in (core.read_namespaced_pod(name, namespace).metadata.annotations or {})
    status = get_job(kube, namespace, "premade")["status"]
    assert "barrier" not in status and not (status.get("actorPods") or {}).get("ready"), status


def test_a_hand_edit_of_the_groups_leader_worker_set_replaces_it_whole(kube: client.ApiClient, namespace: str) -> None:
    """Issue 46 item 2: a member of the break-glass group (whom admission lets past) adds VLLM_ATTENTION_BACKEND to
    the leader template of the job's LeaderWorkerSet with kubectl patch, a field the operator does not set. The
    operator deletes the set and makes it anew, without the edit; ParityLocked says Drift, naming the editor; the
    job's new groups run."""
    from test_hardening import _once_rbac_allows
    from test_security import RBAC, impersonating, pod_rbac

    running_groups(kube, namespace)
    before = group_set(kube, namespace, "big-actor")
    assert before is not None
    leader_uid = client.CoreV1Api(kube).read_namespaced_pod("big-actor-0", namespace).metadata.uid
    glass = {"kind": "Group", "name": keys.BREAK_GLASS_GROUP, "apiGroup": RBAC}
    apply(kube, pod_rbac(namespace, glass, ["patch"], desired.LEADER_WORKER_SETS, desired.LEADER_WORKER_SET_GROUP))
    editor = client.CustomObjectsApi(impersonating(kube, "alice", keys.BREAK_GLASS_GROUP))
    backend = {"name": "VLLM_ATTENTION_BACKEND", "value": "TORCH_SDPA"}
    edit = [
        {"op": "add", "path": "/spec/leaderWorkerTemplate/leaderTemplate/spec/containers/0/env/-", "value": backend}
    ]

    def patch() -> object:
        return editor.patch_namespaced_custom_object(
            *SETS,
            namespace,
            desired.LEADER_WORKER_SETS,
            "big-actor",
            edit,
            field_manager="kubectl-patch",
            _content_type="application/json-patch+json",
        )

    wait_for(lambda: _once_rbac_allows(patch), "the RoleBinding to let alice patch the LeaderWorkerSet")

    def drift() -> list[str]:
        return [e.message for e in events_for(kube, namespace, "big") if e.reason == "Drift" and e.type == "Warning"]

    wait_for(drift, "the Drift Warning Event")  # the condition's transition; it is True again once replaced
    named = (
        "ParityLocked=False: LeaderWorkerSet big-actor's spec was changed by kubectl-patch (Update), not by Lockstep"
    )
    assert all(message.startswith(named) for message in drift()), drift()

    def runs_anew() -> bool:
        job = get_job(kube, namespace, "big")
        status = job.get("status") or {}
        now = pods(kube, namespace).get("big-actor-0")
        return (
            condition(job, "Ready").get("status") == "True"
            and (status.get("actorPods") or {}).get("ready") == len(PODS)
            and now is not None
            and now.metadata.uid != leader_uid
        )

    wait_for(runs_anew, "the job's groups to run anew", timeout=90)
    after = group_set(kube, namespace, "big-actor")
    assert after is not None and after["metadata"]["uid"] != before["metadata"]["uid"], "replaced, not patched back"
    assert after["spec"]["leaderWorkerTemplate"] == before["spec"]["leaderWorkerTemplate"], "without the edit"
    assert condition(get_job(kube, namespace, "big"), "ParityLocked")["status"] == "True"
