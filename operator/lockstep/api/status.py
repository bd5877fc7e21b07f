"""RLJob.status: what the operator observed and did: the phase, conditions, replicas, the Kueue queue, the committed
weights, the barrier in flight and the finished ones, the trainer's last parity measurement. The wire documents it
embeds are in lockstep.protocol."""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field

from lockstep.protocol import (
    BarrierPhase,
    Command,
    EvalResult,
    Mismatch,
    OutputResult,
    PreflightResult,
    TransferGroup,
    Weights,
)
from lockstep.schema import Model


class BarrierStatus(Model):
    """The open barrier, as recorded in ``RLJob.status.barrier``."""

    id: str = Field(
        description="<job uid>/<version>/<n>: names the barrier in every command and ack; n counts the barriers "
        "opened over the job's life (status.barriersOpened), so no two barriers of a job share an id"
    )
    version: int = Field(description="the weights version being loaded")
    attempt: int = Field(
        1, description="collective backends: the attempt at this version's transfer (a retry is a new barrier)"
    )
    uri: str = Field(description="where the weights are (a directory on the shared volume, or a manifest URL)")
    digest: str = Field(description="sha256 of the weights, checked by every member")
    bytes: int | None = Field(None, description="the version's size in bytes, as the trainer announced it")
    phase: BarrierPhase = Field(description="Pause, Update or Resume: what the members are asked to do now")
    members: dict[str, str] = Field(description="pod name → pod UID")
    sender: str | None = Field(
        None, description="collective backends: the member that sends the weights (trainer rank 0), rank 0 of the group"
    )
    started_at: str = Field(description="when the barrier opened (RFC 3339)")
    phase_started_at: str = Field(description="when the current phase began (RFC 3339)")
    deadline: str = Field(description="when the current phase times out")
    phase_seconds: dict[str, float] = Field(default_factory=dict, description="phase → how long it took, in seconds")
    slowest: dict[str, str] = Field(default_factory=dict, description="phase → the last member to ack it")
    evicted: list[str] = Field(default_factory=list, description="members evicted as stragglers (onTimeout)")
    reported: dict[str, str] = Field(default_factory=dict, description="pod → invalid ack already reported")
    transfer_ranks: dict[str, int] = Field(
        default_factory=dict,
        description="collective backends, from the Update phase on: member → its first rank in the transfer group",
    )
    transfer_world_size: int | None = Field(
        None, description="collective backends, from the Update phase on: ranks in the transfer group"
    )
    retries: dict[str, int] = Field(
        default_factory=dict, description="member → how often the current phase was asked again after an error"
    )

    def weights(self) -> Weights:
        return Weights(version=self.version, uri=self.uri, digest=self.digest, bytes=self.bytes)

    def command(self, member: str) -> Command:
        """The command for ``member``: its rank in the transfer group, when it has one, in the Update phase."""
        group = None
        if self.phase is BarrierPhase.UPDATE and member in self.transfer_ranks and self.transfer_world_size:
            group = TransferGroup(rank_offset=self.transfer_ranks[member], world_size=self.transfer_world_size)
        return Command(
            id=self.id,
            version=self.version,
            uri=self.uri,
            digest=self.digest,
            phase=self.phase,
            group=group,
            retry=self.retries.get(member, 0),
        )


class BarrierOutcome(StrEnum):
    COMPLETED = "Completed"
    FAILED = "Failed"
    INTERRUPTED = "Interrupted"


class BarrierRecord(Model):
    """One finished barrier, kept in ``RLJob.status.barrierHistory``."""

    id: str = Field(description="<job uid>/<version>")
    version: int = Field(description="the weights version the barrier loaded")
    outcome: BarrierOutcome = Field(
        description="Completed: every member serves the version; Failed: none committed; Interrupted: the job's pods "
        "were stopped (queued, preempted or suspended) while it was open, none committed"
    )
    seconds: float = Field(description="from opening to closing, in seconds")
    phase_seconds: dict[str, float] = Field(description="phase → how long it took, in seconds")
    slowest_pod: str | None = Field(None, description="the member that acked the longest phase last")
    members: int = Field(description="how many pods took part")
    bytes: int | None = Field(None, description="the version's size in bytes, as the trainer announced it")
    evicted: list[str] = Field(default_factory=list, description="members evicted as stragglers")
    reason: str | None = Field(
        None,
        description="why an interrupted barrier closed: Suspended, QuotaExceeded, or Kueue's reason (Preempted...)",
    )
    finished_at: str | None = Field(None, description="when the barrier closed (RFC 3339)")
    error: str | None = Field(
        None, description="why a failed barrier failed: the members' errors, or the transfer's, in words"
    )


class ConditionStatus(StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class Condition(Model):
    """A metav1.Condition."""

    type: str = Field(description="Ready, ParityLocked, ParityDegraded, Queued, Reconciling or Stalled")
    status: ConditionStatus = Field(description="True, False or Unknown")
    reason: str = Field(description="why, in one CamelCase word")
    message: str = Field("", description="why, for people")
    last_transition_time: str = Field(description="when status last changed (RFC 3339)")
    observed_generation: int | None = Field(None, description="the metadata.generation the condition describes")


class Phase(StrEnum):
    PENDING = "Pending"
    RUNNING = "Running"
    SUSPENDED = "Suspended"
    QUEUED = "Queued"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


class ReplicaStatus(Model):
    desired: int = Field(0, description="pods the spec asks for")
    ready: int = Field(0, description="of them, pods that are ready")
    summary: str = Field("0/0", description="ready/desired, for kubectl get.")


class QueueStatus(Model):
    """Where Kueue holds the job: a job labelled kueue.x-k8s.io/queue-name, with the operator's Kueue integration on."""

    local_queue: str = Field(description="The LocalQueue the job waits in (its label kueue.x-k8s.io/queue-name).")
    workload: str | None = Field(
        None, description="The job's Kueue Workload: one gang of its actor, trainer and preflight pods."
    )
    cluster_queue: str | None = Field(None, description="The ClusterQueue that admitted the Workload, while admitted.")


class RLJobStatus(Model):
    """What the operator observed and did: pods, committed weights, the barrier in flight, parity."""

    phase: Phase = Field(
        Phase.PENDING, description="Pending, Running, Suspended, Queued (waiting for Kueue), Succeeded or Failed."
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        description="Ready, ParityLocked, ParityDegraded, Queued (Kueue), and for kstatus Reconciling and Stalled.",
    )
    queue: QueueStatus | None = Field(None, description="Where Kueue holds the job (jobs Kueue manages only).")
    observed_generation: int | None = Field(None, description="The metadata.generation the status describes.")
    actors: ReplicaStatus = Field(
        default_factory=ReplicaStatus,
        description="The actor pods; with spec.actors.group the groups, a group ready when its leader is (its "
        "engine serves only once every rank of it runs).",
    )
    actor_pods: ReplicaStatus | None = Field(
        None, description="With spec.actors.group: every pod of the groups, leaders and workers. Unset otherwise."
    )
    trainer: ReplicaStatus = Field(default_factory=ReplicaStatus, description="The trainer pods.")
    weights_version: int | None = Field(None, description="The version every member serves (last barrier).")
    weights: Weights | None = Field(None, description="The committed weights; new pods start from them.")
    lag: int | None = Field(None, description="Newest announced version minus the oldest version an actor serves.")
    barrier: BarrierStatus | None = Field(None, description="The weight update in flight.")
    barrier_history: list[BarrierRecord] = Field(default_factory=list, description="The most recent barriers.")
    barriers_opened: int = Field(
        0, description="Barriers opened over the job's life: the last part of the newest barrier's id."
    )
    mismatch: Mismatch | None = Field(None, description="The trainer's last parity measurement.")
    evaluation: EvalResult | None = Field(None, description="The trainer's last evaluation (spec.trainer.eval).")
    output: OutputResult | None = Field(None, description="The trained model the trainer wrote last (spec.output).")
    preflight: PreflightResult | None = Field(None, description="The preflight parity check's result.")
    config_fingerprint: str | None = Field(
        None, description="sha256 of the effective configuration, also on every pod (a pod that differs is drift)."
    )
    parity_policy: str | None = Field(None, description="The ParityPolicy that was applied.")
    restarts: int = Field(0, description="Failures: pods that failed or vanished (counted against spec.maxRestarts).")
    replacements: int = Field(
        0,
        description="Pods the operator replaced by choice: spec edits, ParityPolicy changes, drift and straggler "
        "evictions (never counted against spec.maxRestarts).",
    )
    replacing: list[str] = Field(
        default_factory=list, description="Pods the operator deleted to replace them, not yet recreated."
    )
    restarting: list[str] = Field(
        default_factory=list,
        description="Pods lost in the restart under way (failed or vanished, and the trainer ranks restarted with "
        "them), not yet recreated: a further loss before they are back joins that restart.",
    )
    refused_announcement: str | None = Field(
        None, description="The trainer's last weights announcement the operator refused (reported once as an Event)."
    )
    last_restart_time: str | None = Field(None, description="When the operator last restarted failed pods (RFC 3339).")
    finished_time: str | None = Field(None, description="When the job succeeded or failed (RFC 3339).")
