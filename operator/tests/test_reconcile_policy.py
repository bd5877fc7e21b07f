"""The policy step (lockstep.reconcile.policy): the parity gate, one situation at a time."""

from __future__ import annotations

from factories import REWARD, job, policy
from lockstep.conditions import PARITY_LOCKED, READY, find
from lockstep.reconcile import Plan
from reconcile_helpers import condition, plan_for, settle


def test_enforced_conflict_creates_no_pods_and_names_each_key() -> None:
    plan = plan_for(job(actors={"image": "a", "vllm": {"logprobsMode": "raw_logprobs", "asyncScheduling": True}}))
    assert not plan.create_pods
    assert condition(plan, PARITY_LOCKED) == ("False", "ConflictsWithPolicy")
    message = find(plan.status.conditions, PARITY_LOCKED).message  # type: ignore[union-attr]
    assert "spec.actors.vllm.logprobsMode=raw_logprobs (locked to processed_logprobs)" in message
    assert "spec.actors.vllm.asyncScheduling=true (locked to false)" in message


def test_policy_tightened_later_removes_the_running_pods() -> None:
    body, pods = settle(job(actors={"image": "a", "vllm": {"maxModelLen": 512}}))
    stricter = policy()
    stricter["spec"]["vllm"]["maxModelLen"] = 1024
    plan = plan_for(body, pods, policies=[stricter])
    assert set(plan.delete_pods) == {p["metadata"]["name"] for p in pods}
    assert condition(plan, PARITY_LOCKED) == ("False", "ConflictsWithPolicy")


def test_warn_runs_with_locked_values_and_emits_a_warning() -> None:
    plan = plan_for(
        job(actors={"image": "a", "vllm": {"enablePrefixCaching": True}}), policies=[policy(enforcement="Warn")]
    )
    assert plan.create_pods
    assert "--no-enable-prefix-caching" in plan.create_pods[0]["spec"]["containers"][0]["args"]
    assert condition(plan, PARITY_LOCKED) == ("True", "LockedValuesApplied")
    assert any(e.type == "Warning" and e.reason == "LockedValuesApplied" for e in plan.events)


def test_missing_policy_keeps_existing_pods_and_says_so() -> None:
    body, pods = settle(job())
    plan = plan_for(body, pods, policies=[])
    assert not plan.delete_pods and not plan.create_pods
    status, reason = condition(plan, PARITY_LOCKED)
    assert (status, reason) == ("False", "NoDefaultPolicy")
    assert "the 3 existing pods keep running with the last applied configuration" in (
        find(plan.status.conditions, PARITY_LOCKED).message  # type: ignore[union-attr]
    )


def lora_job(**spec: object) -> dict[str, object]:
    return job(trainer={"image": "t", "reward": REWARD, "lora": {"rank": 8}}, **spec)


def message(plan: Plan, type_: str) -> str:
    found = find(plan.status.conditions, type_)
    assert found is not None
    return found.message


def test_an_enforce_policy_that_forbids_lora_stops_a_lora_job_and_says_why() -> None:
    """Also a job created before the policy forbade it, or past its admission: its pods go."""
    body, pods = settle(lora_job())
    plan = plan_for(body, pods, policies=[policy(lora="Forbidden")])
    assert set(plan.delete_pods) == {p["metadata"]["name"] for p in pods} and not plan.create_pods
    assert condition(plan, PARITY_LOCKED) == ("False", "ConflictsWithPolicy")
    assert condition(plan, READY) == ("False", "ConflictsWithPolicy")
    assert message(plan, PARITY_LOCKED) == (
        "spec.trainer.lora: ParityPolicy 'default' (Enforce) forbids LoRA adapters (its spec.lora is Forbidden); "
        "remove spec.trainer.lora to train every weight, or name a ParityPolicy whose spec.lora is Allowed; no pods "
        "run until then"
    )


def test_an_enforce_policy_that_requires_lora_runs_no_pods_of_a_full_fine_tuning_job() -> None:
    plan = plan_for(job(actors={"image": "a", "vllm": {"seed": 3}}), policies=[policy(lora="Required")])
    assert not plan.create_pods
    assert condition(plan, PARITY_LOCKED) == ("False", "ConflictsWithPolicy")
    assert message(plan, PARITY_LOCKED).startswith(
        "spec.trainer.lora: ParityPolicy 'default' (Enforce) requires a LoRA adapter (its spec.lora is Required); "
        "set spec.trainer.lora"
    )
    assert any(e.type == "Warning" and e.reason == "ConflictsWithPolicy" for e in plan.events)


def test_an_enforce_policy_names_both_a_locked_key_and_the_lora_requirement() -> None:
    plan = plan_for(
        lora_job(actors={"image": "a", "vllm": {"logprobsMode": "raw_logprobs"}}),
        policies=[policy(lora="Forbidden")],
    )
    text = message(plan, PARITY_LOCKED)
    assert "spec.actors.vllm.logprobsMode=raw_logprobs (locked to processed_logprobs)" in text
    assert "spec.trainer.lora: ParityPolicy 'default' (Enforce) forbids LoRA adapters" in text


def test_warn_runs_a_lora_job_a_policy_forbids_as_written_with_a_warning() -> None:
    plan = plan_for(lora_job(), policies=[policy(lora="Forbidden", enforcement="Warn")])
    assert plan.create_pods
    assert condition(plan, PARITY_LOCKED) == ("True", "LoraNotAsPolicyRequires")
    assert message(plan, PARITY_LOCKED) == (
        "ParityPolicy 'default' (Warn) records that spec.trainer.lora is set (the policy's spec.lora is Forbidden: "
        "full fine-tuning only); the trainer trains its adapter all the same (a policy never adds or drops an "
        "adapter); to comply, create the RLJob again without spec.trainer.lora (it is immutable)"
    )
    assert any(e.type == "Warning" and e.reason == "LoraNotAsPolicyRequires" for e in plan.events)
    assert plan.status.config_fingerprint == plan_for(lora_job()).status.config_fingerprint


def test_warn_names_the_overridden_keys_and_the_lora_requirement() -> None:
    plan = plan_for(
        job(actors={"image": "a", "vllm": {"enablePrefixCaching": True}}),
        policies=[policy(lora="Required", enforcement="Warn")],
    )
    assert plan.create_pods
    assert condition(plan, PARITY_LOCKED) == ("True", "LoraNotAsPolicyRequires")
    text = message(plan, PARITY_LOCKED)
    assert text.startswith(
        "ParityPolicy 'default' (Warn) overrode: spec.actors.vllm.enablePrefixCaching=true (locked to false); the "
        "pods run with the locked values; records that spec.trainer.lora is not set (the policy's spec.lora is "
        "Required: LoRA jobs only); the trainer trains every weight all the same"
    )
    assert text.endswith("create the RLJob again with spec.trainer.lora (it is immutable)")


def test_audit_records_a_lora_requirement_the_job_does_not_meet() -> None:
    plan = plan_for(job(), policies=[policy(lora="Required", enforcement="Audit")])
    assert plan.create_pods
    assert condition(plan, PARITY_LOCKED) == ("False", "AuditOnly")
    assert message(plan, PARITY_LOCKED).startswith(
        "ParityPolicy 'default' (Audit) records that spec.trainer.lora is not set"
    )
    assert any(e.type == "Warning" and e.reason == "AuditOnly" for e in plan.events)


def test_a_lora_job_under_an_allowing_or_requiring_policy_is_locked() -> None:
    for requirement in ("Allowed", "Required"):
        plan = plan_for(lora_job(), policies=[policy(lora=requirement)])
        assert plan.create_pods
        assert condition(plan, PARITY_LOCKED) == ("True", "Locked"), requirement
