"""The budget step (lockstep.reconcile.budget): what the trainer measured, against the mismatch budget."""

from __future__ import annotations

import json

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
