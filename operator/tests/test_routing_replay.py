"""Routing replay (spec.actors.routingReplay, ParityPolicy spec.routingReplay): the effective configuration of a
replaying job, the CRDs' CEL rules and the parity admission policy's checks (evaluated offline as the API server
does), and the operator's refusal and warnings."""

from __future__ import annotations

from typing import Any

import pytest
from test_parity import BEFORE_LORA

from factories import evaluate, job, policy
from lockstep import admission, api
from lockstep.api import ParityPolicy, RLJobSpec
from lockstep.cli import schema_errors
from lockstep.conditions import PARITY_LOCKED, READY, find
from lockstep.desired import pod_config
from lockstep.parity import effective_config, routing_replay_refusal
from reconcile_helpers import condition, plan_for

GROUP = {"pods": 2, "tensorParallelSize": 2, "pipelineParallelSize": 1}
PIPELINED = {"pods": 2, "tensorParallelSize": 1, "pipelineParallelSize": 2}


def replay_job(replay: bool = True, **actors: Any) -> dict[str, Any]:
    return job(actors={"image": "a", "routingReplay": replay, **actors})


def config_of(body: dict[str, Any], **policy_spec: Any) -> Any:
    return effective_config(RLJobSpec.model_validate(body["spec"]), ParityPolicy.model_validate(policy(**policy_spec)))


def test_a_replaying_job_gets_prefix_caching_and_a_cache_clearing_update_over_the_default_policy() -> None:
    plain, replaying = config_of(job()), config_of(replay_job())
    assert (plain.vllm["enablePrefixCaching"], plain.weight_update["clearCache"]) == (False, False)
    assert (replaying.vllm["enablePrefixCaching"], replaying.weight_update["clearCache"]) == (True, True)
    assert replaying.routing_replay and not replaying.conflicts and not replaying.refused
    # The rest of the locks hold; only what replay needs changes.
    assert {k: v for k, v in replaying.vllm.items() if k != "enablePrefixCaching"} == {
        k: v for k, v in plain.vllm.items() if k != "enablePrefixCaching"
    }
    assert replaying.document()["routingReplay"] is True
    assert replaying.fingerprint != plain.fingerprint


def test_a_job_that_does_not_replay_keeps_the_fingerprint_it_had_before_replay_existed() -> None:
    config = config_of(job())
    assert "routingReplay" not in config.document() and config.fingerprint == BEFORE_LORA


def test_the_pods_configuration_says_whether_they_replay() -> None:
    for body, replays in ((job(), False), (replay_job(), True)):
        config = config_of(body)
        pod = pod_config(RLJobSpec.model_validate(body["spec"]), config)
        assert pod.routing_replay is replays
        assert pod.vllm.enable_prefix_caching is replays and pod.weight_update.clear_cache is replays
        assert pod.fingerprint == config.fingerprint


def required(**spec: Any) -> dict[str, Any]:
    """A policy that requires replay, coherent: it states the prefix caching and the cache clearing replay needs."""
    locked = policy(routingReplay="Required", **spec)
    locked["spec"]["vllm"]["enablePrefixCaching"] = True
    locked["spec"]["weightUpdate"]["clearCache"] = True
    return locked


@pytest.mark.parametrize("enforcement", ["Enforce", "Warn", "Audit"])
def test_a_policy_that_requires_replay_makes_every_job_replay(enforcement: str) -> None:
    config = effective_config(
        RLJobSpec.model_validate(job()["spec"]), ParityPolicy.model_validate(required(enforcement=enforcement))
    )
    assert config.routing_replay and config.routing_replay_conflict is None and not config.refused
    assert (config.vllm["enablePrefixCaching"], config.weight_update["clearCache"]) == (True, True)


def test_a_policy_that_requires_replay_refuses_a_pipeline_parallel_job_under_enforce_and_reports_otherwise() -> None:
    spec = RLJobSpec.model_validate(job(actors={"image": "a", "group": PIPELINED})["spec"])
    enforced = effective_config(spec, ParityPolicy.model_validate(required()))
    assert enforced.refused and not enforced.routing_replay
    assert enforced.refusals() == [
        "spec.actors.group.pipelineParallelSize: ParityPolicy 'default' (Enforce) requires routing replay (its "
        "spec.routingReplay is Required), which vLLM cannot do with pipeline parallelism; set "
        "spec.actors.group.pipelineParallelSize to 1, or name a ParityPolicy whose spec.routingReplay is Allowed"
    ]
    warned = effective_config(spec, ParityPolicy.model_validate(required(enforcement="Warn")))
    assert not warned.refused and not warned.routing_replay
    assert warned.routing_replay_conflict == enforced.routing_replay_conflict


FORBIDDEN_REFUSAL = (
    "spec.actors.routingReplay: ParityPolicy 'default' (Enforce) forbids routing replay (its spec.routingReplay is "
    "Forbidden); set spec.actors.routingReplay to false, or name a ParityPolicy whose spec.routingReplay is Allowed"
)


def test_a_policy_that_forbids_replay_refuses_a_replaying_job_under_enforce_and_runs_it_as_written_otherwise() -> None:
    enforced = config_of(replay_job(), routingReplay="Forbidden")
    assert enforced.refused and enforced.refusals() == [FORBIDDEN_REFUSAL]
    for enforcement in ("Warn", "Audit"):
        reported = config_of(replay_job(), routingReplay="Forbidden", enforcement=enforcement)
        assert not reported.refused and reported.routing_replay  # a policy never turns a job's replay off
        assert reported.differences() == [
            "spec.actors.routingReplay is true (the policy's spec.routingReplay is Forbidden)"
        ]
    assert not config_of(job(), routingReplay="Forbidden").refused


def test_the_operator_refuses_a_replaying_job_an_enforce_policy_forbids() -> None:
    plan = plan_for(replay_job(), policies=[policy(routingReplay="Forbidden")])
    assert not plan.create_pods
    assert condition(plan, PARITY_LOCKED) == ("False", "ConflictsWithPolicy")
    assert condition(plan, READY) == ("False", "ConflictsWithPolicy")
    found = find(plan.status.conditions, PARITY_LOCKED)
    assert found is not None and found.message == f"{FORBIDDEN_REFUSAL}; no pods run until then"


def test_warn_runs_a_replaying_job_a_policy_forbids_as_written_with_a_warning() -> None:
    plan = plan_for(replay_job(), policies=[policy(routingReplay="Forbidden", enforcement="Warn")])
    assert plan.create_pods
    assert "--enable-prefix-caching" in plan.create_pods[0]["spec"]["containers"][0]["args"]
    assert condition(plan, PARITY_LOCKED) == ("True", "RoutingReplayNotAsPolicyRequires")
    found = find(plan.status.conditions, PARITY_LOCKED)
    assert found is not None and found.message == (
        "ParityPolicy 'default' (Warn) records that spec.actors.routingReplay is true (the policy's "
        "spec.routingReplay is Forbidden); the actors replay their routing all the same; to comply, set "
        "spec.actors.routingReplay to false"
    )
    assert any(e.type == "Warning" and e.reason == "RoutingReplayNotAsPolicyRequires" for e in plan.events)
    assert plan.status.config_fingerprint == plan_for(replay_job()).status.config_fingerprint


# -- the CRDs' rules ---------------------------------------------------------------------------------------------


def test_a_replaying_job_may_not_set_prefix_caching_itself() -> None:
    assert schema_errors(replay_job()["spec"]) == []
    for value in (True, False):
        assert schema_errors(replay_job(vllm={"enablePrefixCaching": value})["spec"]) == [
            "spec.actors.vllm.enablePrefixCaching: Invalid value: spec.actors.routingReplay turns vLLM's prefix "
            "caching on itself (vLLM returns the routed experts only with it, and each weight update then clears the "
            "cache): remove spec.actors.vllm.enablePrefixCaching, or set routingReplay to false"
        ]
    assert schema_errors(replay_job(False, vllm={"enablePrefixCaching": False})["spec"]) == []


def test_a_replaying_job_may_not_be_pipeline_parallel() -> None:
    assert schema_errors(replay_job(group=GROUP)["spec"]) == []
    assert schema_errors(replay_job(False, group=PIPELINED)["spec"]) == []
    assert schema_errors(replay_job(group=PIPELINED)["spec"]) == [
        "spec.actors.routingReplay: Invalid value: spec.actors.routingReplay: vLLM cannot return the routed experts "
        "with pipeline parallelism: set spec.actors.group.pipelineParallelSize to 1 (shard with tensorParallelSize "
        "or expertParallel instead), or set routingReplay to false"
    ]


def policy_rule_holds(spec: dict[str, Any]) -> bool:
    return bool(evaluate(api.REPLAY_PREFIX_CACHE_RULE["rule"], self=spec))


def test_a_policy_that_requires_replay_must_state_prefix_caching_and_cache_clearing() -> None:
    assert policy_rule_holds(required()["spec"])
    default = policy()["spec"]  # prefix caching locked off, the cache kept
    assert policy_rule_holds(default)
    assert not policy_rule_holds({**default, "routingReplay": "Required"})
    unset = required()["spec"]
    del unset["vllm"]["enablePrefixCaching"]
    assert not policy_rule_holds(unset)
    keeping = required()["spec"]
    keeping["weightUpdate"]["clearCache"] = False
    assert not policy_rule_holds(keeping)
    assert api.REPLAY_PREFIX_CACHE_RULE["fieldPath"] == ".routingReplay"
    assert (
        "Set vllm.enablePrefixCaching: true and weightUpdate.clearCache: true"
        in (api.REPLAY_PREFIX_CACHE_RULE["message"])
    )
    rules = api.ParityPolicySpec.model_json_schema()["x-kubernetes-validations"]
    assert api.REPLAY_PREFIX_CACHE_RULE in rules and api.PREFIX_CACHE_RULE in rules
    # The two rules agree on a coherent Required policy.
    assert bool(evaluate(api.PREFIX_CACHE_RULE["rule"], self=required()["spec"]))


# -- the parity admission policy ---------------------------------------------------------------------------------


def _check(requirement: api.Requirement) -> dict[str, str]:
    [check] = [c for c in admission.routing_replay_validations() if f"'{requirement.value}'" in c["expression"]]
    return check


@pytest.mark.parametrize(
    ("requirement", "actors", "refused"),
    [
        ("Forbidden", {"routingReplay": True}, True),
        ("Forbidden", {"routingReplay": False}, False),
        ("Required", {"routingReplay": False, "group": PIPELINED}, True),
        ("Required", {"routingReplay": False, "group": GROUP}, False),
        ("Required", {"routingReplay": False}, False),
    ],
)
def test_the_parity_admission_policy_refuses_what_an_enforce_policy_forbids_or_cannot_require(
    requirement: str, actors: dict[str, Any], refused: bool
) -> None:
    check = _check(api.Requirement(requirement))
    activation = {
        "object": {"spec": {"actors": {"image": "a", **actors}}},
        "params": {"metadata": {"name": "strict"}, "spec": {"routingReplay": requirement}},
    }
    assert bool(evaluate(check["expression"], **activation, variables={"enforced": True})) is not refused
    assert bool(evaluate(check["expression"], **activation, variables={"enforced": False}))
    assert evaluate(check["messageExpression"], **activation) == routing_replay_refusal(
        api.Requirement(requirement), "strict"
    )
    assert check["reason"] == "Invalid"


def test_an_allowing_policy_refuses_no_replaying_job() -> None:
    for check in admission.routing_replay_validations():
        for actors in ({"routingReplay": True}, {"routingReplay": True, "group": PIPELINED}):
            activation = {
                "object": {"spec": {"actors": {"image": "a", **actors}}},
                "params": {"metadata": {"name": "lax"}, "spec": {"routingReplay": "Allowed"}},
                "variables": {"enforced": True},
            }
            assert bool(evaluate(check["expression"], **activation))


def test_the_parity_admission_policy_carries_the_routing_replay_checks() -> None:
    assert admission.policy()["spec"]["validations"][-2:] == admission.routing_replay_validations()


def test_warn_runs_a_pipeline_parallel_job_a_policy_requires_to_replay_without_replay_and_says_so() -> None:
    plan = plan_for(job(actors={"image": "a", "group": PIPELINED}), policies=[required(enforcement="Warn")])
    assert condition(plan, PARITY_LOCKED) == ("True", "RoutingReplayNotAsPolicyRequires")
    found = find(plan.status.conditions, PARITY_LOCKED)
    assert found is not None and found.message == (
        "ParityPolicy 'default' (Warn) records that spec.actors.group.pipelineParallelSize is above 1, with which vLLM "
        "cannot return the routed experts (the policy's spec.routingReplay is Required); the actors run without "
        "routing replay; to comply, create the RLJob again with spec.actors.group.pipelineParallelSize 1 "
        "(spec.actors.group is immutable)"
    )
