"""Step: Kueue's say (lockstep.kueue). A job labelled kueue.x-k8s.io/queue-name is one Workload; its pods wait
until Kueue admits it, go where the admitted flavors say, and stop when Kueue evicts it."""

from __future__ import annotations

from typing import Any

from lockstep import desired, kueue
from lockstep.api import Phase, QueueStatus, RLJobSpec
from lockstep.conditions import QUEUED, READY
from lockstep.reconcile import completion, summary
from lockstep.reconcile.context import Pass
from lockstep.reconcile.reasons import Reason


def admit(run: Pass, spec: RLJobSpec, pods: list[dict[str, Any]]) -> desired.Placements | None:
    """Where ``pods`` (every pod of the job) go once Kueue admitted the job's Workload ({} when Kueue does not
    manage the job), or None while it waits in its queue (its pods are deleted, its phase is Queued)."""
    view = run.observed.kueue
    queue = kueue.queue_name(run.observed.job)
    if view is None:
        if queue is not None:
            run.condition(
                QUEUED,
                False,
                Reason.KUEUE_INTEGRATION_OFF,
                f"the job is labelled {kueue.QUEUE_LABEL}={queue}, but the operator's Kueue integration is off "
                "(the chart's kueue.enabled, the operator's --kueue): it runs without waiting for quota",
            )
        return {}
    if queue is None:
        run.plan.remove_children += [(kueue.WORKLOAD, w["metadata"]["name"]) for w in view.workloads]
        run.status.queue = None
        run.status.conditions = [c for c in run.status.conditions if c.type != QUEUED]
        return {}
    try:
        priority = kueue.priority(run.observed.job, view.priority_classes)
    except LookupError as error:
        _wait(run, spec, QueueStatus(local_queue=queue), Reason.PRIORITY_CLASS_NOT_FOUND, str(error))
        return None
    wanted = kueue.workload(run.job, queue, pods, active=not spec.suspend, priority=priority)
    name = wanted["metadata"]["name"]
    current = next((w for w in view.workloads if w["metadata"]["name"] == name), None)
    run.plan.children.append(desired.onto(wanted, current))
    # Other pod sets than the admitted ones: the old Workload goes, and the new one waits for admission.
    run.plan.remove_children += [(kueue.WORKLOAD, w["metadata"]["name"]) for w in view.workloads if w is not current]
    queued = QueueStatus(local_queue=queue, workload=name)
    lost_from = _admitted_then_lost(run, name) if current is None else None
    if lost_from is not None:
        message = (
            f"Workload {name}, admitted to ClusterQueue {lost_from}, was deleted while the job ran; the operator "
            "creates it again, and the job's pods wait for Kueue to admit it"
        )
        run.replace(dict.fromkeys(run.pods, f"their Kueue Workload {name} was deleted: they wait for its admission"))
        _wait(run, spec, queued, Reason.WORKLOAD_DELETED, message)
        return None
    decided = kueue.state(current)
    if isinstance(decided, kueue.Evicting):
        assert current is not None
        if not kueue.holding_quota(run.own_pods):
            run.plan.workload_status[name] = kueue.release(current, decided, run.now)
        message = (
            f"Kueue evicted Workload {name} ({decided.reason}: {decided.message}); its pods are deleted, the "
            "status and committed weights are kept, and it resumes from them once admitted again"
        )
        _wait(run, spec, queued, decided.reason, message)
        return None
    if isinstance(decided, kueue.Waiting):
        _wait(run, spec, queued, decided.reason, decided.message)
        return None
    missing = view.flavors.missing(decided)
    if missing:
        _wait(run, spec, queued, Reason.FLAVOR_NOT_FOUND, f"ResourceFlavor(s) {missing} not found")
        return None
    run.status.queue = QueueStatus(local_queue=queue, workload=name, cluster_queue=decided.cluster_queue)
    message = f"Kueue admitted Workload {name} to ClusterQueue {decided.cluster_queue}"
    run.condition(QUEUED, False, Reason.ADMITTED, message)
    return kueue.placements(decided, view.flavors)


def _admitted_then_lost(run: Pass, name: str) -> str | None:
    """The ClusterQueue that had admitted the Workload ``name``, now gone, while the job's pods ran (it was
    deleted by hand: Kueue's own job integrations create it again, and so does the operator); else None."""
    last = run.old.queue
    if last is None or last.workload != name or not run.pods:
        return None
    return last.cluster_queue


def _wait(run: Pass, spec: RLJobSpec, queued: QueueStatus, reason: str, message: str) -> None:
    """The job waits for Kueue: no pods, status Queued with Kueue's reason (spec.suspend says Suspended)."""
    run.status.queue = queued
    text = f"waiting in LocalQueue {queued.local_queue} for Kueue to admit Workload {queued.workload}: {message}"
    run.condition(QUEUED, True, reason, text)
    if spec.suspend:
        return
    completion.interrupt_barrier(run, reason, f"the job waits in LocalQueue {queued.local_queue} for Kueue")
    run.stop_all_pods(spec, "Kueue has not admitted the job (or evicted it)")
    run.status.phase = Phase.QUEUED
    run.condition(READY, False, Reason.QUEUED, text)
    summary.count(run, spec, {})
