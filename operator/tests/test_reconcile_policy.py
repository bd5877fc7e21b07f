"""The policy step (lockstep.reconcile.policy): the parity gate, one situation at a time."""

from __future__ import annotations

from factories import job, policy
from lockstep.conditions import PARITY_LOCKED, find
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
