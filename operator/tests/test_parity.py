"""Policy selection and the merge of a job's vLLM settings with the locked ones."""

from __future__ import annotations

import pytest

from factories import job, policy
from lockstep.api import Enforcement, MismatchBudget, ParityPolicy, RLJobSpec
from lockstep.parity import PolicyError, effective_config, preflight_breach, select_policy
from lockstep.protocol import PreflightResult


def spec(**vllm: object) -> RLJobSpec:
    body = job()["spec"]
    body["actors"]["vllm"] = vllm
    return RLJobSpec.model_validate(body)


def policies(*bodies: dict[str, object]) -> list[ParityPolicy]:
    return [ParityPolicy.model_validate(b) for b in bodies]


def test_a_job_without_a_policy_name_gets_the_single_default() -> None:
    chosen = select_policy(None, policies(policy("strict", default=False), policy("default")), "ns", {})
    assert chosen.metadata["name"] == "default"


def test_a_named_policy_that_does_not_exist_is_a_clear_error() -> None:
    with pytest.raises(PolicyError) as error:
        select_policy("nope", policies(policy()), "ns", {})
    assert error.value.reason == "PolicyNotFound"
    assert str(error.value) == (
        "spec.parityPolicy: ParityPolicy 'nope' does not exist; create it or name an existing one "
        "(kubectl get paritypolicies)"
    )


def test_no_default_and_two_defaults_are_errors_that_say_what_to_do() -> None:
    with pytest.raises(PolicyError, match=r"no ParityPolicy has spec\.default: true") as none:
        select_policy(None, policies(policy(default=False)), "ns", {})
    assert none.value.reason == "NoDefaultPolicy"
    with pytest.raises(PolicyError, match=r"2 ParityPolicies are marked default \(a, b\)") as two:
        select_policy(None, policies(policy("b"), policy("a")), "ns", {})
    assert two.value.reason == "AmbiguousDefaultPolicy"


def test_namespace_selector_limits_where_a_policy_applies() -> None:
    scoped = policies(policy(namespaceSelector={"matchLabels": {"team": "rl"}}))
    assert select_policy(None, scoped, "ns", {"team": "rl", "x": "y"}).metadata["name"] == "default"
    with pytest.raises(PolicyError, match="does not apply to namespace 'ns'") as error:
        select_policy(None, scoped, "ns", {"team": "web"})
    assert error.value.reason == "PolicyNotApplicable"


def test_locked_values_win_and_conflicts_are_named() -> None:
    config = effective_config(spec(logprobsMode="raw_logprobs", maxModelLen=512), policies(policy())[0])
    assert config.vllm["logprobsMode"] == "processed_logprobs"
    assert config.vllm["maxModelLen"] == 512
    assert config.refused
    assert [c.describe() for c in config.conflicts] == [
        "spec.actors.vllm.logprobsMode=raw_logprobs (locked to processed_logprobs)"
    ]


def test_warn_applies_locked_values_without_refusing_and_audit_keeps_the_jobs_values() -> None:
    warn = effective_config(spec(enablePrefixCaching=True), policies(policy(enforcement="Warn"))[0])
    assert warn.enforcement is Enforcement.WARN and not warn.refused
    assert warn.vllm["enablePrefixCaching"] is False
    audit = effective_config(spec(enablePrefixCaching=True), policies(policy(enforcement="Audit"))[0])
    assert audit.vllm["enablePrefixCaching"] is True
    assert len(audit.conflicts) == 1 and not audit.refused


def test_fingerprint_is_canonical_and_changes_with_the_config() -> None:
    base = policies(policy())[0]
    first = effective_config(spec(maxModelLen=512, seed=1), base)
    reordered = effective_config(spec(seed=1, maxModelLen=512), base)
    other = effective_config(spec(maxModelLen=1024, seed=1), base)
    assert first.fingerprint == reordered.fingerprint
    assert first.fingerprint != other.fingerprint
    assert first.fingerprint.startswith("sha256:") and len(first.fingerprint) == 7 + 64


def lora_spec(**lora: object) -> RLJobSpec:
    body = job()["spec"]
    body["trainer"]["lora"] = lora
    return RLJobSpec.model_validate(body)


BEFORE_LORA = "sha256:eebe9754efd2d0afca33de2cd94c899c663ec5b4e30a473fc7b35209d1f45e34"
"""The fingerprint of the factories' job under the default policy before spec.trainer.lora existed (commit 23674aa):
were it to change, every running job's pods would be replaced as drift."""


def test_the_fingerprint_covers_the_adapter_and_a_job_without_one_keeps_its_own() -> None:
    base = policies(policy())[0]
    full = effective_config(spec(), base)
    assert "lora" not in full.document()
    assert full.fingerprint == BEFORE_LORA
    rank_8, rank_16 = effective_config(lora_spec(rank=8), base), effective_config(lora_spec(rank=16), base)
    assert rank_8.document()["lora"] == {
        "rank": 8,
        "alpha": 32.0,
        "dropout": 0.0,
        "targetModules": None,
        "trainLmHead": False,
    }
    assert rank_8.fingerprint != rank_16.fingerprint
    assert BEFORE_LORA not in (rank_8.fingerprint, rank_16.fingerprint)
    assert effective_config(lora_spec(rank=8), base).fingerprint == rank_8.fingerprint


@pytest.mark.parametrize(
    ("requirement", "job_spec", "refusal"),
    [
        (
            "Forbidden",
            lora_spec(rank=8),
            "spec.trainer.lora: ParityPolicy 'default' (Enforce) forbids LoRA adapters (its spec.lora is Forbidden); "
            "remove spec.trainer.lora to train every weight, or name a ParityPolicy whose spec.lora is Allowed",
        ),
        (
            "Required",
            spec(),
            "spec.trainer.lora: ParityPolicy 'default' (Enforce) requires a LoRA adapter (its spec.lora is Required); "
            "set spec.trainer.lora (e.g. {rank: 16}, with spec.weightSync.backend filesystem), or name a ParityPolicy "
            "whose spec.lora is Allowed",
        ),
    ],
)
def test_a_policy_that_forbids_or_requires_lora_refuses_under_enforce_and_reports_otherwise(
    requirement: str, job_spec: RLJobSpec, refusal: str
) -> None:
    enforced = effective_config(job_spec, policies(policy(lora=requirement))[0])
    assert enforced.refused and not enforced.conflicts
    assert enforced.lora_conflict is not None and enforced.lora_conflict.requirement.value == requirement
    assert enforced.refusals() == [refusal]
    for enforcement in ("Warn", "Audit"):
        reported = effective_config(job_spec, policies(policy(lora=requirement, enforcement=enforcement))[0])
        assert not reported.refused and reported.lora_conflict == enforced.lora_conflict
        # Neither Warn nor Audit adds or drops the adapter: the job trains what it says.
        lora = job_spec.trainer.lora
        adapter = None if lora is None else lora.model_dump(mode="json", by_alias=True)
        assert reported.lora == enforced.lora == adapter and reported.document() == enforced.document()


def test_a_job_that_meets_the_lora_requirement_has_no_conflict() -> None:
    for requirement, job_spec in [
        ("Allowed", spec()),
        ("Allowed", lora_spec()),
        ("Required", lora_spec()),
        ("Forbidden", spec()),
    ]:
        config = effective_config(job_spec, policies(policy(lora=requirement))[0])
        assert config.lora_conflict is None and not config.refused, requirement


def test_vllm_and_lora_conflicts_are_both_refused_the_vllm_keys_first() -> None:
    body = job()["spec"]
    body["actors"]["vllm"] = {"logprobsMode": "raw_logprobs"}
    body["trainer"]["lora"] = {}
    config = effective_config(RLJobSpec.model_validate(body), policies(policy(lora="Forbidden"))[0])
    assert [line.split(":")[0] for line in config.refusals()] == ["spec.actors.vllm.logprobsMode", "spec.trainer.lora"]


def test_differences_name_the_vllm_keys_then_the_lora_requirement() -> None:
    body = job()["spec"]
    body["actors"]["vllm"] = {"seed": 1}
    locked = policy(lora="Required", enforcement="Audit")
    locked["spec"]["vllm"]["seed"] = 2
    config = effective_config(RLJobSpec.model_validate(body), policies(locked)[0])
    assert config.differences() == [
        "spec.actors.vllm.seed=1 (locked to 2)",
        "spec.trainer.lora is not set (the policy's spec.lora is Required: LoRA jobs only)",
    ]


MEASURED_ON_SMOLLM2 = [
    # (configuration, plain sampling's mean |Δlogprob|, after an in-flight update's, sound?): docs/parity.md
    ("locked (default), bf16", 0.0402, 0.139, True),
    ("locked (default), fp32 model", 8.3e-6, 2.0e-5, True),
    ("locked (default) + LoRA r16, bf16", 0.0423, 0.0689, True),
    ("locked (default), fp16", 0.00415, 0.0374, True),
    ("locked (default) + LoRA r16, fp16", 0.00494, 0.0072, True),
    ("raw logprobs at temperature 0.7, bf16", 0.465, 0.465, False),
    ("locked + prefix caching with keep, bf16", 0.0402, 3.94, False),
    ("the stale tied head (before its fix), fp32 model", 8.3e-6, 2.04, False),
    ("the stale tied head (before its fix), bf16 without the fp32 head", 0.034, 2.0, False),
]


@pytest.mark.parametrize(("configuration", "plain", "after", "sound"), MEASURED_ON_SMOLLM2)
def test_the_default_budget_passes_sound_configurations_of_a_real_model_and_fails_broken_ones(
    configuration: str, plain: float, after: float, sound: bool
) -> None:
    result = PreflightResult(
        mean_abs_logprob_diff=plain,
        shared_prefix_mean_abs_logprob_diff=after,
        clip_fraction=0.0,
        outside_top_p_per_thousand=0.0,
        tokens=1024,
    )
    breach = preflight_breach(result, MismatchBudget().mean_abs_logprob_diff)
    assert (breach is None) == sound, f"{configuration}: {breach}"


def test_a_breach_after_an_update_names_the_bound_and_the_likely_cause() -> None:
    result = PreflightResult(
        mean_abs_logprob_diff=0.04,
        shared_prefix_mean_abs_logprob_diff=0.5,
        clip_fraction=0.0,
        outside_top_p_per_thousand=0.0,
        tokens=1024,
    )
    assert preflight_breach(result, 0.1) == (
        "after an in-flight update the mean |Δlogprob| is 0.5, over 0.4 (the larger of the budget and 10x plain "
        "sampling's 0.04): the engine computes with something other than the new weights after an update (a stale "
        "head, a reused KV cache)"
    )
    assert preflight_breach(result.model_copy(update={"shared_prefix_mean_abs_logprob_diff": 0.09}), 0.1) is None
