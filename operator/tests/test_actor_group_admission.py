"""spec.actors.group at admission: the CRD's CEL rules for the engine splits vLLM refuses, in the words `lockstep
validate` shares with the API server, and the group's immutability."""

from __future__ import annotations

from typing import Any

import pytest

from factories import evaluate, job
from lockstep import api
from lockstep.cli import schema_errors


def group_errors(**group: Any) -> list[str]:
    """What admission says of a job whose actors are groups of ``group``."""
    spec = job()["spec"]
    spec["actors"]["group"] = group
    return schema_errors(spec)


def test_single_pod_actors_are_admitted_as_before() -> None:
    assert schema_errors(job()["spec"]) == []


@pytest.mark.parametrize(
    "group",
    [
        {"pods": 2, "tensorParallelSize": 2},
        {"pods": 2, "tensorParallelSize": 16},
        {"pods": 4, "tensorParallelSize": 8, "pipelineParallelSize": 2},
        {"pods": 2, "pipelineParallelSize": 2},
        {"pods": 2, "dataParallelSize": 4, "tensorParallelSize": 8, "expertParallel": True},
    ],
)
def test_a_split_into_whole_ranks_per_pod_is_admitted(group: dict[str, Any]) -> None:
    assert group_errors(**group) == []


@pytest.mark.parametrize(
    "group",
    [
        {"pods": 2, "tensorParallelSize": 3},
        {"pods": 2},
        {"pods": 4, "tensorParallelSize": 2},
        {"pods": 2, "dataParallelSize": 3, "tensorParallelSize": 2},
    ],
)
def test_ranks_that_do_not_split_evenly_over_the_pods_are_refused_with_the_fix(group: dict[str, Any]) -> None:
    assert group_errors(**group) == [
        "spec.actors.group: Invalid value: spec.actors.group: the engine's ranks must split into whole engines over "
        "the group's pods, every pod running the same number (vLLM gives each node the same local world size): with "
        "dataParallelSize 1, tensorParallelSize x pipelineParallelSize must be a multiple of pods; with "
        "dataParallelSize above 1, dataParallelSize must be a multiple of pods (each pod runs whole data-parallel "
        "engines); change the sizes or pods"
    ]


def test_expert_parallel_with_nothing_to_shard_experts_over_is_refused() -> None:
    assert group_errors(pods=2, pipelineParallelSize=2, expertParallel=True) == [
        "spec.actors.group.expertParallel: Invalid value: spec.actors.group.expertParallel shards a MoE "
        "model's experts over tensorParallelSize times dataParallelSize ranks, and both are 1: raise one of them, "
        "or set expertParallel to false"
    ]


def test_a_group_and_the_single_pod_tensor_parallel_size_together_are_refused() -> None:
    spec = job()["spec"]
    spec["actors"]["group"] = {"pods": 2, "tensorParallelSize": 2}
    spec["actors"]["vllm"] = {"tensorParallelSize": 2}
    assert (
        "spec.actors.vllm.tensorParallelSize: Invalid value: spec.actors.vllm.tensorParallelSize and "
        "spec.actors.group both size the engine's tensor parallelism: with a group, set "
        "spec.actors.group.tensorParallelSize and remove spec.actors.vllm.tensorParallelSize"
    ) in schema_errors(spec)


def test_a_group_of_one_pod_is_refused_by_the_schema() -> None:
    spec = job()["spec"]
    spec["actors"]["group"] = {"pods": 1}
    assert schema_errors(spec) == [
        "spec.actors.group.pods: Invalid value: 1: spec.actors.group.pods in body should be greater than or equal to 2"
    ]


GROUP = {"pods": 2, "tensorParallelSize": 2}


@pytest.mark.parametrize(
    ("old", "new", "allowed"),
    [
        (None, None, True),
        (GROUP, GROUP, True),
        (None, GROUP, False),  # added: the actor pods are the operator's, the groups' pods a LeaderWorkerSet's
        (GROUP, None, False),  # removed
        (GROUP, {**GROUP, "pods": 4, "tensorParallelSize": 4}, False),  # resized
    ],
)
def test_spec_actors_group_is_immutable_including_adding_and_removing_it(
    old: dict[str, Any] | None, new: dict[str, Any] | None, allowed: bool
) -> None:
    rule = api.GROUP_IMMUTABLE_RULE
    actors = {"image": "a", "replicas": 2}
    before, after = {**actors, **({"group": old} if old else {})}, {**actors, **({"group": new} if new else {})}
    assert bool(evaluate(rule["rule"], self=after, oldSelf=before)) is allowed
    assert rule["message"].endswith("delete the RLJob and create it again with the spec.actors.group you want")
    assert rule in api.ActorSpec.model_json_schema()["x-kubernetes-validations"], "on spec.actors, not on the field"
