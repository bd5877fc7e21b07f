"""Step: the preflight parity check. Before training starts, a pod of its own samples with the job's effective
configuration and recomputes the tokens with the trainer's forward pass; training starts only within budget."""

from __future__ import annotations

from lockstep import keys, protocol
from lockstep.api import Phase, RLJobSpec
from lockstep.conditions import PARITY_LOCKED, READY
from lockstep.parity import EffectiveConfig, preflight_breach
from lockstep.protocol import PreflightResult
from lockstep.reconcile import completion
from lockstep.reconcile.children import Children
from lockstep.reconcile.context import Next, Pass, annotation, pod_phase
from lockstep.reconcile.reasons import Reason


def run_check(run: Pass, spec: RLJobSpec, config: EffectiveConfig, children: Children) -> Next:
    """Run the preflight pod and judge what it measured; CONTINUE once it passed (training may start)."""
    wanted = children.desired.preflight
    assert wanted is not None
    name, found = wanted["metadata"]["name"], children.preflight
    if run.status.preflight is not None:
        if found is not None:
            run.plan.delete_pods[name] = "the preflight check finished"
        return Next.CONTINUE
    if found is None:
        run.plan.create_pods = [wanted]
    phase = pod_phase(found) if found else "Pending"
    if phase == "Failed":
        completion.finish_job(
            run, spec, Phase.FAILED, Reason.PREFLIGHT_FAILED, f"the preflight pod {name} failed; see its log"
        )
        run.plan.delete_pods[name] = "the preflight check failed"
        return Next.DONE
    if phase != "Succeeded":
        run.status.phase = Phase.PENDING
        message = f"pod {name} is checking train-inference parity before training starts"
        run.condition(READY, False, Reason.PREFLIGHT, message)
        return Next.DONE
    assert found is not None
    run.plan.delete_pods[name] = "the preflight check finished"
    result = protocol.read_document(annotation(found, keys.PREFLIGHT), PreflightResult)
    if not isinstance(result, PreflightResult):
        why = result or "wrote no result"
        completion.finish_job(run, spec, Phase.FAILED, Reason.PREFLIGHT_FAILED, f"the preflight pod {name} {why}")
        return Next.DONE
    run.status.preflight = result
    limit = config.mismatch_budget.mean_abs_logprob_diff
    numbers = (
        f"mean |Δlogprob| {result.mean_abs_logprob_diff:.3g}, after an in-flight update with shared prompts "
        f"{result.shared_prefix_mean_abs_logprob_diff:.3g}, clip fraction {result.clip_fraction:.3g} over "
        f"{result.tokens} tokens; budget {limit:.3g} (ParityPolicy {config.policy!r})"
    )
    if breach := preflight_breach(result, limit):
        message = f"the preflight parity check is over budget: {breach}; {numbers}"
        completion.finish_job(run, spec, Phase.FAILED, Reason.MISMATCH_BUDGET_EXCEEDED, message)
        run.condition(PARITY_LOCKED, False, Reason.MISMATCH_BUDGET_EXCEEDED, message)
        return Next.DONE
    run.event(Reason.PREFLIGHT_PASSED, f"the preflight parity check passed: {numbers}")
    return Next.CONTINUE
