"""Step: failures. Pods that failed or vanished are one restart, counted against spec.maxRestarts and
recreated after a backoff; what the operator replaced by choice is never counted (status.replacing)."""

from __future__ import annotations

from typing import Any

from lockstep import keys, protocol
from lockstep.api import Phase, RLJobSpec
from lockstep.conditions import READY
from lockstep.reconcile import completion
from lockstep.reconcile.children import Children
from lockstep.reconcile.context import Next, Pass, pod_phase, role
from lockstep.reconcile.reasons import Reason
from lockstep.times import parse_rfc3339

MAX_BACKOFF_SECONDS = 300.0


def restart_backoff_seconds(restarts: int, base: float = 10.0) -> float:
    """Wait before recreating pods after the n-th restart: base, 2·base, 4·base, ... capped at 5 minutes."""
    return min(base * 2.0 ** max(restarts - 1, 0), MAX_BACKOFF_SECONDS)


def carry_over(run: Pass) -> None:
    """What the last passes replaced or restarted and is not back yet (a pod that came back is no longer)."""
    run.status.replacing = [name for name in run.old.replacing if name not in run.pods]
    run.status.restarting = [
        name for name in run.old.restarting if name not in run.pods or pod_phase(run.pods[name]) == "Failed"
    ]


def count_losses(run: Pass, spec: RLJobSpec, children: Children) -> Next:
    """Count failed or vanished pods as one restart (a loss while one is under way joins it); DONE when the job
    failed for good."""
    run.status.restarting = [name for name in run.status.restarting if name in children.desired.pods]
    for name in children.failed:
        run.plan.delete_pods[name] = "it failed"
    gave_up = [
        name
        for name in children.failed
        if role(run.pods[name]) == keys.TRAINER and exit_code(run.pods[name]) == protocol.TRAINER_GAVE_UP_EXIT_CODE
    ]
    if gave_up:
        why = termination_message(run.pods[gave_up[0]]) or "it left no termination message"
        verdict = (
            f"trainer pod {gave_up[0]} stopped for good ({why}): a restart would resume from the same committed "
            "weights, so the job fails without spending spec.maxRestarts"
        )
        completion.finish_job(run, spec, Phase.FAILED, Reason.TRAINER_GAVE_UP, verdict)
        return Next.DONE
    lost = children.failed + children.vanished
    if not lost:
        return Next.CONTINUE
    group: list[str] = []
    if spec.trainer.replicas > 1 and any(
        role(children.desired.pods.get(n) or run.pods[n]) == keys.TRAINER for n in lost
    ):
        why = "its torch.distributed group lost a rank: the ranks restart together"
        for name, pod in children.pods.items():
            if role(pod) == keys.TRAINER and name not in run.plan.delete_pods:
                run.plan.delete_pods[name] = why
                group.append(name)
    under_way = bool(run.status.restarting)
    run.status.restarting += [name for name in lost + group if name not in run.status.restarting]
    if under_way:
        return Next.CONTINUE
    run.status.restarts += 1
    run.status.last_restart_time = run.now
    what = f"pod(s) {', '.join(lost)} failed or were deleted"
    said = [f"{name}: {message}" for name in children.failed if (message := termination_message(run.pods[name]))]
    if said:
        what += f" ({'; '.join(said)})"
    if run.status.restarts > spec.max_restarts:
        message = f"{what}; the job already restarted {spec.max_restarts} time(s) (spec.maxRestarts)"
        completion.finish_job(run, spec, Phase.FAILED, Reason.RESTART_LIMIT_EXCEEDED, message)
        return Next.DONE
    delay = restart_backoff_seconds(run.status.restarts, run.observed.backoff_base_seconds)
    message = f"{what}; restart {run.status.restarts} of {spec.max_restarts} in {delay:.0f}s"
    run.condition(READY, False, Reason.RESTARTING, message)
    run.event(Reason.RESTARTING, message, warning=True)
    return Next.CONTINUE


TERMINATION_MESSAGE_CHARACTERS = 400
"""How much of a failed container's termination message the status quotes (its end, where the error is)."""


def termination_message(pod: dict[str, Any]) -> str | None:
    """The last line of the termination message of the pod's failed container, if it left one."""
    for terminated in _terminated(pod):
        if lines := (terminated.get("message") or "").strip().splitlines():
            return lines[-1][-TERMINATION_MESSAGE_CHARACTERS:]
    return None


def exit_code(pod: dict[str, Any]) -> int | None:
    """The exit code of the pod's first terminated container, if one terminated."""
    return next((terminated.get("exitCode") for terminated in _terminated(pod)), None)


def _terminated(pod: dict[str, Any]) -> list[dict[str, Any]]:
    """The terminated states of the pod's containers, in their order."""
    states = [container.get("state") or {} for container in pod.get("status", {}).get("containerStatuses") or []]
    return [state["terminated"] for state in states if state.get("terminated")]


def backoff_remaining(run: Pass) -> float:
    """Seconds until the pods of the restart under way may be recreated (0: none under way, or now)."""
    if not run.status.restarting or run.status.last_restart_time is None:
        return 0.0
    delay = restart_backoff_seconds(run.status.restarts, run.observed.backoff_base_seconds)
    elapsed = (run.observed.now - parse_rfc3339(run.status.last_restart_time)).total_seconds()
    return max(delay - elapsed, 0.0)
