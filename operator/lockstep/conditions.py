"""metav1.Condition bookkeeping: set a condition by type, keeping lastTransitionTime when
the status does not change."""

from __future__ import annotations

from lockstep.api import Condition, ConditionStatus

READY = "Ready"
PARITY_LOCKED = "ParityLocked"
PARITY_DEGRADED = "ParityDegraded"
QUEUED = "Queued"  # Kueue: True while the job waits for admission
WEIGHTS_FIT_MEMORY = "WeightsFitMemory"  # False while the actors' memory limit cannot stage the announced weights
TRAINER_REPORTS_VALID = "TrainerReportsValid"  # False while the trainer's mismatch or evaluation document is refused
# kstatus (Flux, kubectl wait, cli-utils) reads these two beside Ready.
RECONCILING = "Reconciling"
STALLED = "Stalled"


def find(conditions: list[Condition], type_: str) -> Condition | None:
    return next((c for c in conditions if c.type == type_), None)


def set_condition(
    conditions: list[Condition],
    type_: str,
    status: bool,
    reason: str,
    message: str,
    *,
    generation: int | None,
    now: str,
) -> list[Condition]:
    """Return ``conditions`` with ``type_`` set; other types keep their place."""
    new_status = ConditionStatus.TRUE if status else ConditionStatus.FALSE
    old = find(conditions, type_)
    transition = old.last_transition_time if old is not None and old.status == new_status else now
    updated = Condition(
        type=type_,
        status=new_status,
        reason=reason,
        message=message,
        last_transition_time=transition,
        observed_generation=generation,
    )
    if old is None:
        return [*conditions, updated]
    return [updated if c.type == type_ else c for c in conditions]
