"""Policy selection and the merge of a job's vLLM settings with the locked ones."""

from __future__ import annotations

import pytest

from factories import job, policy
from lockstep.api import Enforcement, ParityPolicy, RLJobSpec
from lockstep.parity import PolicyError, effective_config, select_policy


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
