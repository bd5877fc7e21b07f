"""An RLJob whose actors are groups of two pods (spec.actors.group), with LeaderWorkerSet's real controller and
webhooks (lockstep_e2e.lws) beside the session's operator, which has the chart's RBAC for LeaderWorkerSets. Pods are
kwok's; the barrier's agents are the real PodAgent on recording engines, one per group leader, each with a token
bound to its pod (lockstep_e2e.agents)."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client

from lockstep import keys
from lockstep.api import ActorGroup
from lockstep_e2e.agents import running_agents
from lockstep_e2e.fixtures import push_weights, wait_for, weights_version
from lockstep_e2e.jobs import announce_weights, create_job, get_job, rljob
from lockstep_workers.actor.group import node_of

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("lockstep")]

GROUP = {"pods": 2, "tensorParallelSize": 2}
LEADERS = ["big-actor-0", "big-actor-1"]
PODS = {"big-actor-0", "big-actor-0-1", "big-actor-1", "big-actor-1-1"}


def pods(kube: client.ApiClient, namespace: str) -> dict[str, Any]:
    listed = client.CoreV1Api(kube).list_namespaced_pod(namespace, label_selector=f"{keys.JOB}=big")
    return {pod.metadata.name: pod for pod in listed.items if pod.metadata.deletion_timestamp is None}


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
