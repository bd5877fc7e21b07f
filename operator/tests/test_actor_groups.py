"""spec.actors.group: the job's LeaderWorkerSet (lockstep.desired.actor_groups), the ranks a group takes in a
transfer group (lockstep.reconcile.weights.ranks_per_member), and the reconcile of a job whose actors are groups:
LeaderWorkerSet creates and recreates their pods, the operator applies the set, counts the groups, replaces a group
with a drifted pod, and runs the barrier over the leaders."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from factories import SHARED_VOLUME, job, running
from lockstep import desired, keys
from lockstep.api import RLJobSpec
from lockstep.parity import default_policy, effective_config
from lockstep.podconfig import parse_actor_args
from lockstep.reconcile.weights import ranks_per_member
from reconcile_helpers import announce, condition, plan_for, status_of

JOB = desired.JobRef("demo", "team-a", "uid-1")


def spec_of(group: dict[str, Any] | None, **actors: Any) -> RLJobSpec:
    body = job()["spec"]
    body["actors"] |= {"replicas": 3, **actors}
    if group is not None:
        body["actors"]["group"] = group
    return RLJobSpec.model_validate(body)


def groups(spec: RLJobSpec) -> dict[str, Any]:
    return desired.actor_groups(JOB, spec, effective_config(spec, default_policy()))


GROUP = {"pods": 2, "tensorParallelSize": 2}


def test_a_job_of_groups_is_one_leader_worker_set_owned_by_it_with_a_group_per_replica() -> None:
    lws = groups(spec_of(GROUP))
    assert (lws["apiVersion"], lws["kind"]) == ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet")
    assert lws["metadata"]["name"] == "demo-actor", "group i's leader is demo-actor-<i>, a single-pod actor's name"
    assert lws["metadata"]["ownerReferences"] == [JOB.owner_reference()]
    assert lws["spec"]["replicas"] == 3
    template = lws["spec"]["leaderWorkerTemplate"]
    assert template["size"] == 2
    assert template["restartPolicy"] == "RecreateGroupOnPodRestart", "an engine that lost a rank cannot serve"
    assert lws["spec"]["rolloutStrategy"]["rollingUpdateConfiguration"] == {"maxUnavailable": 3, "maxSurge": 0}, (
        "a new template replaces every group at once, as a new fingerprint replaces every single-pod actor"
    )


def test_the_leader_serves_the_engine_and_the_workers_run_its_headless_ranks_with_the_same_arguments() -> None:
    spec = spec_of(GROUP)
    template = groups(spec)["spec"]["leaderWorkerTemplate"]
    [leader] = template["leaderTemplate"]["spec"]["containers"]
    [worker] = template["workerTemplate"]["spec"]["containers"]
    assert leader["command"] == ["python", "-m", "lockstep_workers.actor"]
    assert worker["command"] == ["python", "-m", "lockstep_workers.actor.headless"]
    assert leader["args"] == worker["args"], "every rank runs the same locked settings"
    assert parse_actor_args(leader["args"]).group == spec.actors.group
    assert "readinessProbe" in leader and "ports" in leader
    assert "readinessProbe" not in worker and "ports" not in worker, "the workers serve no API"
    assert template["leaderTemplate"]["metadata"]["labels"][keys.ROLE] == keys.ACTOR
    assert template["workerTemplate"]["metadata"]["labels"][keys.ROLE] == keys.ACTOR_WORKER, (
        "the actors' Service and the barrier select the leaders only"
    )


def test_every_pod_of_a_group_is_restricted_carries_the_fingerprint_and_reads_the_job_directory() -> None:
    spec = spec_of(GROUP)
    config = effective_config(spec, default_policy())
    single = desired.actor_pod(JOB, spec_of(None), effective_config(spec_of(None), default_policy()), 0)
    template = desired.actor_groups(JOB, spec, config)["spec"]["leaderWorkerTemplate"]
    for kind in ("leaderTemplate", "workerTemplate"):
        pod = template[kind]
        assert pod["metadata"]["annotations"][keys.CONFIG_FINGERPRINT] == config.fingerprint
        assert keys.INDEX not in pod["metadata"]["labels"], "LeaderWorkerSet labels each pod's group and index"
        assert pod["spec"]["securityContext"] == single["spec"]["securityContext"]
        [container] = pod["spec"]["containers"]
        assert container["securityContext"] == single["spec"]["containers"][0]["securityContext"]
        assert pod["spec"]["restartPolicy"] == "Always", "a StatefulSet's pods restart in place"
        volumes = {volume["name"]: volume for volume in pod["spec"]["volumes"]}
        assert volumes["lockstep-shared"]["hostPath"] == SHARED_VOLUME["hostPath"], "each rank reads its shard"
        mount = {"name": "lockstep-shared", "mountPath": desired.shared_dir(JOB), "subPath": "uid-1", "readOnly": True}
        assert mount in container["volumeMounts"]


def test_single_pod_actors_render_no_leader_worker_set() -> None:
    with pytest.raises(ValueError, match=r"spec\.actors\.group"):
        groups(spec_of(None))


@given(
    tensor=st.sampled_from([1, 2, 4, 8]),
    pipeline=st.sampled_from([1, 2]),
    data=st.sampled_from([1, 2, 4]),
)
def test_a_group_takes_a_transfer_rank_for_every_worker_of_its_engine(tensor: int, pipeline: int, data: int) -> None:
    group = {"pods": 2, "tensorParallelSize": tensor, "pipelineParallelSize": pipeline, "dataParallelSize": data}
    spec = spec_of(group)
    ranks = tensor * pipeline * data
    assert ranks_per_member(spec, effective_config(spec, default_policy())) == ranks
    assert ranks_per_member(spec, None) == ranks


def test_a_single_pod_actor_takes_its_effective_tensor_parallel_size() -> None:
    spec = spec_of(None, vllm={"tensorParallelSize": 2})
    assert ranks_per_member(spec, effective_config(spec, default_policy())) == 2
    assert ranks_per_member(spec, None) == 2
    assert ranks_per_member(spec_of(None), None) == 1


def grouped_job(**spec: Any) -> dict[str, Any]:
    body = job(**spec)
    body["spec"]["actors"]["group"] = GROUP
    return body


def group_pods(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The job's group pods as LeaderWorkerSet runs them: ready, with its labels (the test's stand-in for it)."""
    spec = RLJobSpec.model_validate(body["spec"])
    job_ref = desired.JobRef(body["metadata"]["name"], body["metadata"]["namespace"], body["metadata"]["uid"])
    pods = [running(pod) for pod in desired.group_pods(job_ref, spec, effective_config(spec, default_policy()))]
    for pod in pods:
        pod["metadata"]["labels"][keys.GROUP_SET_NAME] = desired.actor_set_name(job_ref.name)
    return pods


def running_groups(**spec: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A grouped job after its first pass, with its trainer and its groups' pods running."""
    body = grouped_job(**spec)
    first = plan_for(body)
    pods = [running(pod) for pod in first.create_pods] + group_pods(body)
    return {**body, "status": status_of(first)}, pods


def test_the_operator_creates_the_trainers_and_applies_the_set_and_leader_worker_set_creates_the_actors() -> None:
    plan = plan_for(grouped_job())
    assert [pod["metadata"]["name"] for pod in plan.create_pods] == ["demo-trainer-0"]
    [group_set] = [child for child in plan.children if child["kind"] == "LeaderWorkerSet"]
    assert group_set["spec"]["replicas"] == 2 and group_set["spec"]["leaderWorkerTemplate"]["size"] == 2
    [role] = [child for child in plan.children if child["kind"] == "Role"]
    assert role["rules"][0]["resourceNames"] == ["demo-actor-0", "demo-actor-1", "demo-trainer-0"], (
        "the leaders write their acks; the workers get no access to pods"
    )


def test_running_groups_are_counted_as_groups_and_pods_and_nothing_of_theirs_is_deleted() -> None:
    body, pods = running_groups()
    plan = plan_for(body, pods)
    assert plan.delete_pods == {} and plan.create_pods == []
    status = status_of(plan)
    assert status["actors"] == {"desired": 2, "ready": 2, "summary": "2/2"}
    assert status["actorPods"] == {"desired": 4, "ready": 4, "summary": "4/4"}
    assert status["phase"] == "Running"
    [worker] = [pod for pod in pods if pod["metadata"]["name"] == "demo-actor-0-1"]
    worker["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
    plan = plan_for(body, pods)
    status = status_of(plan)
    assert status["actors"]["summary"] == "2/2" and status["actorPods"]["summary"] == "3/4"
    assert condition(plan, "Ready") == ("False", "PodsNotReady"), "a group runs once every pod of it does"


def test_a_group_with_a_drifted_pod_is_replaced_whole_by_deleting_its_leader() -> None:
    body, pods = running_groups()
    [worker] = [pod for pod in pods if pod["metadata"]["name"] == "demo-actor-1-1"]
    worker["metadata"]["annotations"][keys.CONFIG_FINGERPRINT] = "sha256:other"
    plan = plan_for(body, pods)
    assert list(plan.delete_pods) == ["demo-actor-1"], "LeaderWorkerSet recreates the group whose leader goes"
    assert "drift" in plan.delete_pods["demo-actor-1"]


def test_stopping_the_pods_deletes_the_set_else_leader_worker_set_would_create_them_again() -> None:
    body, pods = running_groups()
    plan = plan_for({**body, "spec": {**body["spec"], "suspend": True}}, pods)
    assert ("LeaderWorkerSet", "demo-actor") in plan.remove_children
    assert not [child for child in plan.children if child["kind"] == "LeaderWorkerSet"]
    assert set(plan.delete_pods) == {pod["metadata"]["name"] for pod in pods}


def test_the_barrier_runs_over_the_leaders_each_taking_a_rank_per_worker_of_its_engine() -> None:
    body, pods = running_groups(weightSync={"backend": "gloo"})
    [trainer] = [pod for pod in pods if pod["metadata"]["name"] == "demo-trainer-0"]
    announce(trainer, 1)
    plan = plan_for(body, pods)
    barrier = status_of(plan)["barrier"]
    assert set(barrier["members"]) == {"demo-actor-0", "demo-actor-1", "demo-trainer-0"}
    assert barrier["transferRanks"] == {"demo-trainer-0": 0, "demo-actor-0": 1, "demo-actor-1": 3}
    assert barrier["transferWorldSize"] == 5
