"""spec.actors.group rendered: the job's LeaderWorkerSet (lockstep.desired.actor_groups), and the ranks a group
takes in a transfer group (lockstep.reconcile.weights.ranks_per_member)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from factories import SHARED_VOLUME, job
from lockstep import desired, keys
from lockstep.api import RLJobSpec
from lockstep.parity import default_policy, effective_config
from lockstep.podconfig import parse_actor_args
from lockstep.reconcile.weights import ranks_per_member

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
    assert lws["spec"]["rolloutStrategy"]["rollingUpdateConfiguration"] == {"maxUnavailable": 1, "maxSurge": 0}


def test_the_leader_serves_the_engine_and_the_workers_run_its_headless_ranks_with_the_same_arguments() -> None:
    spec = spec_of(GROUP)
    template = groups(spec)["spec"]["leaderWorkerTemplate"]
    [leader] = template["leaderTemplate"]["spec"]["containers"]
    [worker] = template["workerTemplate"]["spec"]["containers"]
    assert leader["command"] == ["python", "-m", "lockstep_workers.actor"]
    assert worker["command"] == ["python", "-m", "lockstep_workers.headless"]
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
