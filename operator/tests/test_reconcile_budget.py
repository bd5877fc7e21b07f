"""The budget step (lockstep.reconcile.budget): what the trainer measured, against the mismatch budget."""

from __future__ import annotations

import json

import pytest

from factories import job, policy
from lockstep import keys
from lockstep.conditions import find
from lockstep.protocol import PROTOCOL
from reconcile_helpers import announce, condition, plan_for, settle, status_of


def test_the_trainers_last_evaluation_reaches_the_status_and_lockstep_status() -> None:
    from lockstep.cli import describe_status

    body, pods = settle(job())
    announce(pods[2], 6)
    evaluated = {"protocol": PROTOCOL, "version": 5, "reward": 0.35, "rows": 20}
    pods[2]["metadata"]["annotations"][keys.EVALUATION] = json.dumps(evaluated)
    status = plan_for(body, pods).status
    assert status.evaluation is not None and (status.evaluation.version, status.evaluation.reward) == (5, 0.35)
    shown = describe_status("tiny", status.model_dump(mode="json", by_alias=True, exclude_none=True))
    assert "  trainer's last evaluation: eval reward 0.35 on weights version 5 (20 eval rows, greedy)" in shown
    pods[2]["metadata"]["annotations"][keys.EVALUATION] = "{not json"
    kept = plan_for({**body, "status": status.model_dump(mode="json", by_alias=True)}, pods).status
    assert kept.evaluation == status.evaluation, "a bad document leaves the last good evaluation"


def test_a_mismatch_over_budget_degrades_parity_and_pause_holds_weight_updates() -> None:
    strict = policy(trainer={"mismatchBudget": {"meanAbsLogprobDiff": 0.01, "onExceeded": "Pause"}})
    body, pods = settle(job())
    announce(pods[2], 4)
    measured = {"protocol": PROTOCOL, "step": 4, "meanAbsLogprobDiff": 0.05, "tokenFraction": 0.75}
    pods[2]["metadata"]["annotations"][keys.MISMATCH] = json.dumps(measured)

    held = plan_for(body, pods, policies=[strict])
    assert condition(held, "ParityDegraded") == ("True", "MismatchBudgetExceeded")
    message = find(held.status.conditions, "ParityDegraded").message  # type: ignore[union-attr]
    assert "0.05" in message and "budget 0.01" in message and "weight updates are held" in message
    assert held.status.barrier is None and not held.annotate_pods, "no weight update while held"
    assert any(e.reason == "MismatchBudgetExceeded" and e.type == "Warning" for e in held.events)

    warned = plan_for(body, pods, policies=[policy(trainer={"mismatchBudget": {"meanAbsLogprobDiff": 0.01}})])
    assert condition(warned, "ParityDegraded") == ("True", "MismatchBudgetExceeded")
    assert warned.status.barrier is not None, "Warn (the default) only tells"

    raised = policy(trainer={"mismatchBudget": {"meanAbsLogprobDiff": 0.1, "onExceeded": "Pause"}})
    resumed = plan_for({**body, "status": status_of(held)}, pods, policies=[raised])
    assert condition(resumed, "ParityDegraded") == ("False", "WithinBudget")
    assert resumed.status.barrier is not None and resumed.status.barrier.version == 4


def test_a_limit_on_a_named_metric_degrades_parity_and_pauses_as_the_mean_does() -> None:
    """Issue 24 item 4: ESS below its min (the mean |Δlogprob| within budget) is over budget; the metrics reach
    status.mismatch and lockstep status."""
    from lockstep.cli import describe_status

    limits = [{"metric": "rollout_is_eff_sample_size", "min": 0.3}, {"metric": "k3_kl", "max": 0.1}]
    strict = policy(trainer={"mismatchBudget": {"limits": limits, "onExceeded": "Pause"}})
    body, pods = settle(job())
    announce(pods[2], 4)
    metrics = {"rollout_is_eff_sample_size": 0.2, "k3_kl": 0.05, "rollout_is_masked_fraction": 0.125}
    measured = {"protocol": PROTOCOL, "step": 4, "meanAbsLogprobDiff": 0.001, "tokenFraction": 1.0, "metrics": metrics}
    pods[2]["metadata"]["annotations"][keys.MISMATCH] = json.dumps(measured)

    held = plan_for(body, pods, policies=[strict])
    assert condition(held, "ParityDegraded") == ("True", "MismatchBudgetExceeded")
    message = find(held.status.conditions, "ParityDegraded").message  # type: ignore[union-attr]
    assert "rollout_is_eff_sample_size 0.2 below its min 0.3" in message and "k3_kl" not in message
    assert "weight updates are held" in message and held.status.barrier is None
    assert held.status.mismatch is not None and held.status.mismatch.metrics == metrics
    shown = describe_status("tiny", held.status.model_dump(mode="json", by_alias=True, exclude_none=True))
    assert "  its rollout correction: rollout_is_eff_sample_size 0.2, rollout_is_masked_fraction 0.125, k3_kl 0.05" in (
        shown
    )

    loose = [{"metric": "rollout_is_eff_sample_size", "min": 0.1}, {"metric": "k3_kl", "min": -0.1, "max": 0.1}]
    raised = policy(trainer={"mismatchBudget": {"limits": loose, "onExceeded": "Pause"}})
    resumed = plan_for({**body, "status": status_of(held)}, pods, policies=[raised])
    assert condition(resumed, "ParityDegraded") == ("False", "WithinBudget")
    assert resumed.status.barrier is not None


def test_the_budget_holds_each_limit_in_its_direction() -> None:
    from lockstep.api import MismatchBudget
    from lockstep.protocol import Mismatch
    from lockstep.reconcile.budget import breaches, unmeasured

    measured = Mismatch(step=1, mean_abs_logprob_diff=0.03, token_fraction=1.0, metrics={"k3_kl": -0.2, "ess": 0.9})
    budget = MismatchBudget.model_validate(
        {
            "meanAbsLogprobDiff": 0.02,
            "limits": [
                {"metric": "k3_kl", "min": -0.1, "max": 0.1},
                {"metric": "ess", "min": 0.5},
                {"metric": "chi2_seq", "max": 1.0},  # not announced: not held
            ],
        }
    )
    assert breaches(measured, budget) == ["meanAbsLogprobDiff 0.03 above 0.02", "k3_kl -0.2 below its min -0.1"]
    assert breaches(measured.model_copy(update={"mean_abs_logprob_diff": 0.01, "metrics": {"ess": 0.9}}), budget) == []
    assert unmeasured(measured, budget) == ["chi2_seq"]


@pytest.mark.parametrize(
    ("metrics", "degraded", "said"),
    [
        ({"routing_mismatch": 0.25, "expert_load_imbalance": 1.5}, ("True", "MismatchBudgetExceeded"), None),
        ({"routing_mismatch": 0.05, "expert_load_imbalance": 1.5}, ("False", "WithinBudget"), None),
        ({"expert_load_imbalance": 1.5}, ("False", "WithinBudget"), "routing_mismatch"),
        ({}, ("False", "WithinBudget"), "routing_mismatch, expert_load_imbalance"),
    ],
    ids=["breached", "within", "unmeasured", "dense"],
)
def test_a_limit_on_an_moe_routing_metric_holds_when_measured_and_says_when_not(
    metrics: dict[str, float], degraded: tuple[str, str], said: str | None
) -> None:
    """Issue 44 part 5: routing_mismatch (the MoE analogue of |Δlogprob|) and expert_load_imbalance can be held by
    a budget; a step that measured none (no engine routings, a dense model) announces none, and its limit is neither
    breached nor met: ParityDegraded says it was not measured."""
    limits = [{"metric": "routing_mismatch", "max": 0.1}, {"metric": "expert_load_imbalance", "max": 2.0}]
    body, pods = settle(job())
    announce(pods[2], 4)
    measured = {"protocol": PROTOCOL, "step": 4, "meanAbsLogprobDiff": 0.001, "tokenFraction": 1.0, "metrics": metrics}
    pods[2]["metadata"]["annotations"][keys.MISMATCH] = json.dumps(measured)

    plan = plan_for(body, pods, policies=[policy(trainer={"mismatchBudget": {"limits": limits}})])
    assert condition(plan, "ParityDegraded") == degraded
    message = find(plan.status.conditions, "ParityDegraded").message  # type: ignore[union-attr]
    assert plan.status.mismatch is not None and plan.status.mismatch.metrics == metrics
    assert ("routing_mismatch 0.25 above its max 0.1" in message) == (degraded[0] == "True")
    if said is None:
        assert "not measured" not in message
    else:
        assert message.endswith(f"; not measured on step 4, so not held to their limits: {said}")


def test_fail_ends_the_job_over_budget_naming_the_breach_and_closes_the_open_barrier() -> None:
    """Issue 24 item 4's Fail action: a step over a limit fails the job (Ready False, MismatchBudgetExceeded, the
    metric named), its pods stop, and the barrier open at that moment closes as interrupted, not committed."""
    body, pods = settle(job())
    announce(pods[2], 4)
    opened = plan_for(body, pods)
    assert opened.status.barrier is not None and opened.status.barrier.version == 4
    metrics = {"rollout_is_eff_sample_size": 0.2}
    measured = {"protocol": PROTOCOL, "step": 4, "meanAbsLogprobDiff": 0.001, "tokenFraction": 1.0, "metrics": metrics}
    pods[2]["metadata"]["annotations"][keys.MISMATCH] = json.dumps(measured)
    limits = [{"metric": "rollout_is_eff_sample_size", "min": 0.3}]
    failing = policy(trainer={"mismatchBudget": {"limits": limits, "onExceeded": "Fail"}})

    failed = plan_for({**body, "status": status_of(opened)}, pods, policies=[failing])
    assert failed.status.phase.value == "Failed"
    assert condition(failed, "Ready") == ("False", "MismatchBudgetExceeded")
    message = find(failed.status.conditions, "Ready").message  # type: ignore[union-attr]
    assert "rollout_is_eff_sample_size 0.2 below its min 0.3" in message and "onExceeded: Fail" in message
    assert failed.status.barrier is None and failed.status.barrier_history[-1].outcome.value == "Interrupted"
    assert failed.status.weights_version != 4, "the interrupted version is not committed"
    assert set(failed.delete_pods) == {p["metadata"]["name"] for p in pods}
    assert any(e.reason == "WeightUpdateInterrupted" for e in failed.events)

    within = {**measured, "metrics": {"rollout_is_eff_sample_size": 0.5}}
    pods[2]["metadata"]["annotations"][keys.MISMATCH] = json.dumps(within)
    assert plan_for({**body, "status": status_of(opened)}, pods, policies=[failing]).status.phase.value == "Running"


GOOD = {"protocol": PROTOCOL, "step": 4, "meanAbsLogprobDiff": 0.001, "tokenFraction": 1.0}


@pytest.mark.parametrize(
    ("text", "field"),
    [
        (json.dumps({**GOOD, "meanAbsLogprobDiff": float("inf")}), "meanAbsLogprobDiff: Input should be a finite"),
        (json.dumps({**GOOD, "metrics": {"ess": float("nan")}}), "metrics.ess: Input should be a finite number"),
        (json.dumps({**GOOD, "step": 1180591620717411303424}), "step: the number is beyond int64"),
        (json.dumps({**GOOD, "staleSamplesDropped": -1}), "staleSamplesDropped: Input should be greater than or equal"),
        (
            json.dumps({**GOOD, "meanAbsLogprobDiff": "0.5"}),
            'meanAbsLogprobDiff: Input should be a valid number (got "0.5")',
        ),
        (json.dumps({**GOOD, "tokenFraction": True}), "tokenFraction: Input should be a valid number (got true)"),
        (
            json.dumps({**GOOD, "metrics": {f"m{n}": 0.0 for n in range(1000)}}),
            "metrics: Dictionary should have at most 64",
        ),
    ],
)
def test_a_refused_mismatch_report_is_named_in_a_condition_and_the_jobs_other_work_goes_on(
    text: str, field: str
) -> None:
    """Issue 37 item 1: NaN, Infinity, integers beyond int64, negative counts, strings and bools in the trainer's
    mismatch report made every status write fail (400 invalid JSON patch, 422) and barriers never committed; under
    onExceeded: Fail, Infinity failed the job. The report is refused, naming its field, and the rest goes on."""
    failing = policy(trainer={"mismatchBudget": {"meanAbsLogprobDiff": 0.01, "onExceeded": "Fail"}})
    body, pods = settle(job())
    pods[2]["metadata"]["annotations"][keys.MISMATCH] = json.dumps(GOOD)
    good = plan_for(body, pods, policies=[failing])
    assert condition(good, "TrainerReportsValid") == ("True", "ReportsValid")
    body = {**body, "status": status_of(good)}
    announce(pods[2], 5)
    pods[2]["metadata"]["annotations"][keys.MISMATCH] = text

    refused = plan_for(body, pods, policies=[failing])
    assert condition(refused, "TrainerReportsValid") == ("False", "InvalidTrainerReport")
    [event] = [e for e in refused.events if e.reason == "InvalidTrainerReport"]
    assert (
        event.type == "Warning"
        and f"lockstep.dev/mismatch on the trainer is not a valid Mismatch document: {field}" in event.message
    )
    assert refused.status.phase.value == "Running" and not refused.delete_pods, "onExceeded: Fail is not triggered"
    assert refused.status.mismatch == good.status.mismatch, "the last valid report stays"
    assert refused.status.barrier is not None and refused.status.barrier.version == 5, "weight updates go on"
    json.dumps(status_of(refused), allow_nan=False)  # the status write is a valid JSON patch
    again = plan_for({**body, "status": status_of(refused)}, pods, policies=[failing])
    assert not [e for e in again.events if e.reason == "InvalidTrainerReport"], "reported once, not per pass"


def test_a_refused_evaluation_is_named_in_the_condition_and_the_last_valid_one_stays() -> None:
    body, pods = settle(job())
    pods[2]["metadata"]["annotations"][keys.EVALUATION] = json.dumps(
        {"protocol": PROTOCOL, "version": 5, "reward": 0.35, "rows": 20}
    )
    good = plan_for(body, pods)
    pods[2]["metadata"]["annotations"][keys.EVALUATION] = '{"protocol": 2, "version": 6, "reward": NaN, "rows": 20}'
    refused = plan_for({**body, "status": status_of(good)}, pods)
    assert condition(refused, "TrainerReportsValid") == ("False", "InvalidTrainerReport")
    message = find(refused.status.conditions, "TrainerReportsValid").message  # type: ignore[union-attr]
    assert (
        "lockstep.dev/evaluation on the trainer is not a valid EvalResult document: "
        "reward: Input should be a finite number (got NaN)" in message
    )
    assert refused.status.evaluation == good.status.evaluation
    pods[2]["metadata"]["annotations"][keys.EVALUATION] = json.dumps(
        {"protocol": PROTOCOL, "version": 6, "reward": 0.5, "rows": 20}
    )
    fixed = plan_for({**body, "status": status_of(refused)}, pods)
    assert condition(fixed, "TrainerReportsValid") == ("True", "ReportsValid")


def test_only_the_metrics_a_budget_may_name_reach_the_status() -> None:
    """Issue 37 item 1: every metric key of a report was copied into the status (1000 of them)."""
    body, pods = settle(job())
    metrics = {"ess": 0.9, "k3_kl": 0.01, **{f"made_up_{n}": 1.0 for n in range(40)}}
    pods[2]["metadata"]["annotations"][keys.MISMATCH] = json.dumps({**GOOD, "metrics": metrics})
    status = plan_for(body, pods).status
    assert status.mismatch is not None and status.mismatch.metrics == {"ess": 0.9, "k3_kl": 0.01}


def test_a_negative_mean_absolute_difference_is_refused_not_read_as_within_budget() -> None:
    """Issue 46's risk: meanAbsLogprobDiff -5 read 'WithinBudget'; a mean of absolute values is never negative."""
    strict = policy(trainer={"mismatchBudget": {"meanAbsLogprobDiff": 0.01, "onExceeded": "Pause"}})
    body, pods = settle(job())
    measured = {"protocol": PROTOCOL, "step": 4, "meanAbsLogprobDiff": -5, "tokenFraction": 0.75}
    pods[2]["metadata"]["annotations"][keys.MISMATCH] = json.dumps(measured)
    plan = plan_for(body, pods, policies=[strict])
    assert condition(plan, "TrainerReportsValid") == ("False", "InvalidTrainerReport")
    assert "meanAbsLogprobDiff" in find(plan.status.conditions, "TrainerReportsValid").message  # type: ignore[union-attr]
    assert find(plan.status.conditions, "ParityDegraded") is None, "no verdict on a refused report"
