"""The vocabulary of the reasons the reconciler gives its conditions, and what each kind of reason means to
kstatus and to Events. No state is kept in a reason: what a pass must remember is in the status's own fields."""

from __future__ import annotations

from enum import StrEnum


class Reason(StrEnum):
    # Ready
    ALL_PODS_READY = "AllPodsReady"
    PODS_NOT_READY = "PodsNotReady"
    RESTARTING = "Restarting"
    SUSPENDED = "Suspended"
    QUEUED = "Queued"
    PREFLIGHT = "Preflight"
    FINAL_WEIGHT_UPDATE = "FinalWeightUpdate"
    TRAINER_SUCCEEDED = "TrainerSucceeded"
    INVALID_SPEC = "InvalidSpec"
    CHILD_REJECTED = "ChildRejected"
    POD_NAME_TAKEN = "PodNameTaken"
    QUOTA_EXCEEDED = "QuotaExceeded"
    RESTART_LIMIT_EXCEEDED = "RestartLimitExceeded"
    TRAINER_GAVE_UP = "TrainerGaveUp"
    WEIGHT_UPDATE_FAILED = "WeightUpdateFailed"
    WEIGHT_UPDATE_STALLED = "WeightUpdateStalled"
    PREFLIGHT_FAILED = "PreflightFailed"
    # ParityLocked (and Ready, when the job may not run)
    LOCKED = "Locked"
    LOCKED_VALUES_APPLIED = "LockedValuesApplied"
    LORA_NOT_AS_POLICY_REQUIRES = "LoraNotAsPolicyRequires"
    ROUTING_REPLAY_NOT_AS_POLICY_REQUIRES = "RoutingReplayNotAsPolicyRequires"
    AUDIT_ONLY = "AuditOnly"
    DRIFT = "Drift"
    CONFLICTS_WITH_POLICY = "ConflictsWithPolicy"
    POLICY_NOT_FOUND = "PolicyNotFound"
    NO_DEFAULT_POLICY = "NoDefaultPolicy"
    AMBIGUOUS_DEFAULT_POLICY = "AmbiguousDefaultPolicy"
    POLICY_NOT_APPLICABLE = "PolicyNotApplicable"
    # ParityDegraded
    WITHIN_BUDGET = "WithinBudget"
    MISMATCH_BUDGET_EXCEEDED = "MismatchBudgetExceeded"
    # TrainerReportsValid
    REPORTS_VALID = "ReportsValid"
    INVALID_TRAINER_REPORT = "InvalidTrainerReport"
    # WeightsFitMemory
    WITHIN_MEMORY_LIMIT = "WithinMemoryLimit"
    ACTOR_MEMORY_LIMIT_TOO_LOW = "ActorMemoryLimitTooLow"
    # Queued (Kueue's own reasons, such as Pending or Preempted, pass through as Kueue wrote them)
    ADMITTED = "Admitted"
    PRIORITY_CLASS_NOT_FOUND = "PriorityClassNotFound"
    FLAVOR_NOT_FOUND = "FlavorNotFound"
    KUEUE_INTEGRATION_OFF = "KueueIntegrationOff"
    WORKLOAD_DELETED = "WorkloadDeleted"
    # Events only
    PREFLIGHT_PASSED = "PreflightPassed"
    WEIGHT_UPDATE = "WeightUpdate"
    WEIGHT_UPDATE_INTERRUPTED = "WeightUpdateInterrupted"
    INVALID_WEIGHTS_ANNOUNCEMENT = "InvalidWeightsAnnouncement"
    CREATING_PODS = "CreatingPods"
    DELETING_PODS = "DeletingPods"


WARNING = frozenset(
    {
        Reason.LOCKED_VALUES_APPLIED,
        Reason.LORA_NOT_AS_POLICY_REQUIRES,
        Reason.ROUTING_REPLAY_NOT_AS_POLICY_REQUIRES,
        Reason.MISMATCH_BUDGET_EXCEEDED,
        Reason.WORKLOAD_DELETED,
    }
)
"""Reasons whose transition Event is a Warning even though the condition is True."""
BENIGN = frozenset({Reason.PODS_NOT_READY, Reason.SUSPENDED, Reason.QUEUED, Reason.ADMITTED, Reason.WITHIN_BUDGET})
"""False conditions that are ordinary progress rather than trouble (their Events are Normal)."""
WAITING = frozenset({Reason.SUSPENDED, Reason.QUEUED, Reason.QUOTA_EXCEEDED})
"""Ready=False while the job waits for a person, for Kueue or for quota: neither Stalled nor Reconciling."""
STALLED = frozenset(
    {
        Reason.INVALID_SPEC,
        Reason.CONFLICTS_WITH_POLICY,
        Reason.POLICY_NOT_FOUND,
        Reason.NO_DEFAULT_POLICY,
        Reason.AMBIGUOUS_DEFAULT_POLICY,
        Reason.POLICY_NOT_APPLICABLE,
        Reason.RESTART_LIMIT_EXCEEDED,
        Reason.TRAINER_GAVE_UP,
        Reason.WEIGHT_UPDATE_FAILED,
        Reason.WEIGHT_UPDATE_STALLED,
        Reason.MISMATCH_BUDGET_EXCEEDED,
        Reason.PREFLIGHT_FAILED,
        Reason.CHILD_REJECTED,
        Reason.POD_NAME_TAKEN,
    }
)
"""Ready=False reasons that need a person (fix the spec or the policy, or recreate the job): Stalled, for kstatus."""
