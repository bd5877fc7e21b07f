"""The end of every pass: pod counts, the conditions kstatus reads, and an Event for each transition."""

from __future__ import annotations

from typing import Any

from lockstep import keys
from lockstep.api import ReplicaStatus, RLJobSpec, RLJobStatus
from lockstep.conditions import READY, RECONCILING, STALLED, find
from lockstep.reconcile import reasons
from lockstep.reconcile.context import Pass, Plan, pod_ready, role
from lockstep.reconcile.reasons import Reason


def count(run: Pass, spec: RLJobSpec, live: dict[str, dict[str, Any]]) -> None:
    """Ready and desired actors (groups, with spec.actors.group: their leaders; and then all their pods apart) and
    trainers (``live``: the pods that count)."""

    def replicas(roles: tuple[str, ...], wanted: int) -> ReplicaStatus:
        ready = sum(1 for p in live.values() if role(p) in roles and pod_ready(p))
        return ReplicaStatus(desired=wanted, ready=ready, summary=f"{ready}/{wanted}")

    group = spec.actors.group
    run.status.actors = replicas((keys.ACTOR,), spec.actors.replicas)
    run.status.actor_pods = (
        None if group is None else replicas((keys.ACTOR, keys.ACTOR_WORKER), spec.actors.replicas * group.pods)
    )
    run.status.trainer = replicas((keys.TRAINER,), spec.trainer.replicas)


def all_ready(status: RLJobStatus) -> bool:
    """Every actor (every pod of every group: a leader may pass its probe before LeaderWorkerSet has created its
    workers) and every trainer ready."""
    counts = [status.actors, status.trainer, *([status.actor_pods] if status.actor_pods else [])]
    return all(count.ready == count.desired for count in counts)


def readiness(run: Pass) -> str:
    pods = run.status.actor_pods
    actors = "actors" if pods is None else f"actor groups ({pods.summary} of their pods)"
    return f"{run.status.actors.summary} {actors} and {run.status.trainer.summary} trainer pods ready"


def _for_gitops(run: Pass) -> None:
    """Stalled and Reconciling, as kstatus reads them: both follow from Ready (so no Events of their own)."""
    ready = find(run.status.conditions, READY)
    if ready is None:
        return
    stalled = ready.status.value == "False" and ready.reason in reasons.STALLED
    reconciling = ready.status.value == "False" and not stalled and ready.reason not in reasons.WAITING
    run.condition(STALLED, stalled, ready.reason if stalled else "NotStalled", ready.message if stalled else "")
    run.condition(
        RECONCILING,
        reconciling,
        ready.reason if reconciling else "Reconciled",
        ready.message if reconciling else "",
    )


def finish(run: Pass) -> Plan:
    """Add an Event for each phase or condition transition, and for the pods created and deleted."""
    status, old = run.status, run.old
    if status.phase != old.phase:
        run.event(f"Phase{status.phase.value}", f"phase {old.phase.value} → {status.phase.value}")
    for condition in status.conditions:
        before = find(old.conditions, condition.type)
        if before is None or (before.status, before.reason) != (condition.status, condition.reason):
            warning = condition.reason in reasons.WARNING or (
                condition.status.value == "False" and condition.reason not in reasons.BENIGN
            )
            message = f"{condition.type}={condition.status.value}: {condition.message}"
            run.event(condition.reason, message, warning=warning)
    _for_gitops(run)
    plan = run.plan
    if plan.create_pods:
        names = [p["metadata"]["name"] for p in plan.create_pods]
        run.event(Reason.CREATING_PODS, f"creating {len(names)} pod(s): {_abbreviate(names)}")
    for why in sorted(set(plan.delete_pods.values())):
        names = [n for n, w in plan.delete_pods.items() if w == why]
        run.event(Reason.DELETING_PODS, f"deleting {len(names)} pod(s) because {why}: {_abbreviate(names)}")
    return plan


def _abbreviate(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown} and {len(names) - limit} more"
