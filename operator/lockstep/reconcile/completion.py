"""Step: the end of a job. It succeeds or fails once, its pods go, Kueue learns it ended, and
ttlSecondsAfterFinished deletes it."""

from __future__ import annotations

import datetime as dt

from lockstep import barrier, kueue
from lockstep.api import Phase, RLJobSpec
from lockstep.conditions import READY, find
from lockstep.reconcile import summary
from lockstep.reconcile.context import Pass
from lockstep.reconcile.reasons import Reason
from lockstep.times import parse_rfc3339

FINISHED = (Phase.SUCCEEDED, Phase.FAILED)


def finish_job(run: Pass, spec: RLJobSpec, phase: Phase, reason: Reason, message: str) -> None:
    """The job ends in ``phase`` (Ready says ``reason`` and ``message``); a barrier still open closes as
    interrupted, so a failed job's committed weights are the last every actor took."""
    interrupt_barrier(run, reason, message, resumes=False)
    run.status.phase = phase
    run.status.finished_time = run.now
    run.condition(READY, phase is Phase.SUCCEEDED, reason, message)
    summary.count(run, spec, {})
    tidy_finished(run, spec)


def interrupt_barrier(run: Pass, reason: str, why: str, *, resumes: bool = True) -> None:
    """The job's pods are stopped (``why``, for people): an open barrier closes now as Interrupted (``reason``),
    in its history and an Event; its version is not committed, and, ``resumes``, a new barrier opens once the pods
    run again."""
    open_barrier = run.status.barrier
    if open_barrier is None:
        return
    record = barrier.interrupt(open_barrier, run.observed.now, reason)
    run.status.barrier = None
    run.status.barrier_history = barrier.remember(run.status.barrier_history, record)
    committed = run.status.weights_version
    kept = f"the committed weights stay at version {committed}" if committed else "no weights were committed yet"
    later = ", and a new barrier brings the pods on once they run again" if resumes else ""
    run.event(
        Reason.WEIGHT_UPDATE_INTERRUPTED,
        f"barrier {open_barrier.id} for weights version {open_barrier.version} was interrupted in phase "
        f"{open_barrier.phase.value} because {why} ({reason}); {kept}{later}",
        warning=True,
    )


def tidy_finished(run: Pass, spec: RLJobSpec) -> None:
    """A finished job keeps no pods, its Workload says it finished, and it goes after ttlSecondsAfterFinished."""
    run.stop_all_pods(spec, f"the job {run.status.phase.value.lower()}")
    _finish_workloads(run)
    if spec.ttl_seconds_after_finished is None or run.status.finished_time is None:
        return
    expires = parse_rfc3339(run.status.finished_time) + dt.timedelta(seconds=spec.ttl_seconds_after_finished)
    remaining = (expires - run.observed.now).total_seconds()
    if remaining <= 0:
        run.plan.delete_job = True
    else:
        run.requeue(remaining)


def _finish_workloads(run: Pass) -> None:
    """Tell Kueue the job ended, so that its quota goes to the next job, once none of its pods runs (those being
    deleted included: an actor's vLLM holds its GPUs until it has shut down)."""
    if kueue.holding_quota(run.own_pods):
        return
    ready = find(run.status.conditions, READY)
    message = ready.message if ready is not None else ""
    for workload in run.observed.kueue.workloads if run.observed.kueue else []:
        patch = kueue.finish(workload, run.status.phase is Phase.SUCCEEDED, message, run.now)
        if patch is not None:
            run.plan.workload_status[workload["metadata"]["name"]] = patch
