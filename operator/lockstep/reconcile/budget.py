"""Step: what the trainer measured. Its last evaluation and the model it wrote last (spec.output) go to the status;
its last parity measurement is held against the ParityPolicy's budget (ParityDegraded), over which a policy with
onExceeded: Pause holds new weight updates and one with onExceeded: Fail ends the job. A report the wire documents
refuse (NaN, Infinity, a number beyond int64, a string for a number) is ignored, the last valid one kept, and
TrainerReportsValid=False names the annotation and the field; the job's other work goes on."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from lockstep import keys, protocol
from lockstep.api import BudgetAction, BudgetMetric, MismatchBudget, Phase, RLJobSpec
from lockstep.conditions import PARITY_DEGRADED, TRAINER_REPORTS_VALID, find
from lockstep.parity import EffectiveConfig
from lockstep.protocol import EvalResult, Mismatch, OutputResult
from lockstep.reconcile import completion
from lockstep.reconcile.context import Pass, annotation
from lockstep.reconcile.reasons import Reason


class Updates(Enum):
    """Whether a new weight update may open (one in flight always goes on)."""

    ALLOWED = "allowed"
    HELD = "held"
    FAILED = "failed"
    """The job failed over its budget (onExceeded: Fail): the pass ends."""


REPORTED_METRICS = frozenset(metric.value for metric in BudgetMetric)
"""The metrics of a mismatch report that reach status.mismatch: those a budget may name (others are left out)."""


@dataclass(frozen=True)
class Reports:
    """The trainer's last valid documents on rank 0, each None when absent or refused."""

    mismatch: Mismatch | None
    evaluation: EvalResult | None
    output: OutputResult | None


def reports(run: Pass, rank0: dict[str, Any] | None) -> Reports:
    """The trainer's last mismatch, evaluation and output documents on rank 0. A refused one sets
    TrainerReportsValid=False, naming the annotation and the field (its transition is the Event); once all are valid
    (or gone) it is True again."""
    mismatch = protocol.read_document(annotation(rank0, keys.MISMATCH) if rank0 else None, Mismatch)
    evaluation = protocol.read_document(annotation(rank0, keys.EVALUATION) if rank0 else None, EvalResult)
    output = protocol.read_document(annotation(rank0, keys.OUTPUT) if rank0 else None, OutputResult)
    read = {keys.MISMATCH: mismatch, keys.EVALUATION: evaluation, keys.OUTPUT: output}
    refused = [f"{key} on the trainer {problem}" for key, problem in read.items() if isinstance(problem, str)]
    if refused:
        kept = "ignored (the status keeps the last valid report) until the trainer writes a valid one"
        message = f"{'; '.join(refused)}: {kept}"
        run.condition(TRAINER_REPORTS_VALID, False, Reason.INVALID_TRAINER_REPORT, message)
    elif any(value is not None for value in read.values()) or find(run.status.conditions, TRAINER_REPORTS_VALID):
        run.condition(TRAINER_REPORTS_VALID, True, Reason.REPORTS_VALID, "the trainer's reports are valid")
    return Reports(
        mismatch if isinstance(mismatch, Mismatch) else None,
        evaluation if isinstance(evaluation, EvalResult) else None,
        output if isinstance(output, OutputResult) else None,
    )


def record_results(run: Pass, spec: RLJobSpec, rank0: dict[str, Any] | None) -> None:
    """The trainer's last evaluation and the model it wrote last (on its pod), into status.evaluation and
    status.output; an output report of a job without spec.output is no model the job asked for, and is not copied."""
    found = reports(run, rank0)
    if found.evaluation is not None:
        run.status.evaluation = found.evaluation
    if found.output is not None and spec.output is not None:
        run.status.output = found.output


def check(run: Pass, spec: RLJobSpec, config: EffectiveConfig, rank0: dict[str, Any] | None) -> Updates:
    """Hold the trainer's last measurement against the budget: ParityDegraded, and whether a new weight update may
    open (Pause holds them); over a budget with onExceeded: Fail the job ends here, FAILED."""
    measured = reports(run, rank0).mismatch
    if measured is not None and measured.token_fraction > 0:
        kept = {name: value for name, value in measured.metrics.items() if name in REPORTED_METRICS}
        run.status.mismatch = measured.model_copy(update={"metrics": kept})
    last = run.status.mismatch
    if last is None:
        return Updates.ALLOWED
    budget = config.mismatch_budget
    numbers = (
        f"step {last.step}: mean |Δlogprob| {last.mean_abs_logprob_diff:.3g} between the trainer and the actors "
        f"on {last.token_fraction:.0%} of its tokens; budget {budget.mean_abs_logprob_diff:.3g} "
        f"(ParityPolicy {config.policy!r})"
    )
    absent = unmeasured(last, budget)
    not_held = f"; not measured on step {last.step}, so not held to their limits: {', '.join(absent)}" if absent else ""
    exceeded = breaches(last, budget)
    if not exceeded:
        run.condition(PARITY_DEGRADED, False, Reason.WITHIN_BUDGET, numbers + not_held)
        return Updates.ALLOWED
    advice = {
        BudgetAction.WARN: "",
        BudgetAction.PAUSE: "; weight updates are held (onExceeded: Pause) until a measurement is within the "
        "budget: fix the configuration or raise trainer.mismatchBudget in the ParityPolicy",
        BudgetAction.FAIL: "; the job fails (onExceeded: Fail): fix the configuration or the budget in the "
        "ParityPolicy and apply the job again",
    }[budget.on_exceeded]
    message = f"over budget at {numbers}: {', '.join(exceeded)}{not_held}{advice}"
    run.condition(PARITY_DEGRADED, True, Reason.MISMATCH_BUDGET_EXCEEDED, message)
    if budget.on_exceeded is BudgetAction.FAIL:
        completion.finish_job(run, spec, Phase.FAILED, Reason.MISMATCH_BUDGET_EXCEEDED, message)
        return Updates.FAILED
    return Updates.HELD if budget.on_exceeded is BudgetAction.PAUSE else Updates.ALLOWED


def breaches(measured: Mismatch, budget: MismatchBudget) -> list[str]:
    """What of ``budget`` the step ``measured`` exceeds, in words (none: within it): meanAbsLogprobDiff, then each
    limit on a metric the trainer announced (a metric it did not announce is not held to its limit: ``unmeasured``)."""
    found = []
    if measured.mean_abs_logprob_diff > budget.mean_abs_logprob_diff:
        found.append(
            f"meanAbsLogprobDiff {measured.mean_abs_logprob_diff:.3g} above {budget.mean_abs_logprob_diff:.3g}"
        )
    for limit in budget.limits:
        value = measured.metrics.get(limit.metric.value)
        if value is None:
            continue
        if limit.min is not None and value < limit.min:
            found.append(f"{limit.metric.value} {value:.3g} below its min {limit.min:.3g}")
        if limit.max is not None and value > limit.max:
            found.append(f"{limit.metric.value} {value:.3g} above its max {limit.max:.3g}")
    return found


def unmeasured(measured: Mismatch, budget: MismatchBudget) -> list[str]:
    """The metrics ``budget`` limits that the step ``measured`` did not announce, in the limits' order: it measured
    nothing for them (routing_mismatch without engine routings, an MoE metric of a dense model), so their limits are
    neither met nor exceeded."""
    return list(
        dict.fromkeys(limit.metric.value for limit in budget.limits if limit.metric.value not in measured.metrics)
    )
