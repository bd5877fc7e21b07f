"""What a reconcile pass reads (Observed), what it decides (Plan), and the pass itself (Pass): the state every
step of the pipeline shares, with the few ways a step changes it."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from lockstep import desired, keys, kueue
from lockstep.api import RLJobSpec, RLJobStatus
from lockstep.conditions import set_condition
from lockstep.events import PassScope
from lockstep.reconcile import ownership
from lockstep.times import rfc3339


@dataclass(frozen=True)
class KueueView:
    """What the operator read of Kueue for one job (its Kueue integration on)."""

    workloads: list[dict[str, Any]] = field(default_factory=list)
    """The job's Workloads."""
    flavors: kueue.Flavors = field(default_factory=kueue.Flavors)
    """The ResourceFlavors its admitted Workload names."""
    priority_classes: dict[str, dict[str, Any]] = field(default_factory=dict)
    """The WorkloadPriorityClass the job names (by name), if it exists."""


@dataclass(frozen=True)
class Observed:
    """What the operator read from the API server for one RLJob."""

    job: dict[str, Any]
    pods: list[dict[str, Any]]
    policies: list[dict[str, Any]]
    namespace_labels: dict[str, str]
    now: dt.datetime
    backoff_base_seconds: float = 10.0
    rejected: dict[str, str] = field(default_factory=dict)
    """What the API server refused to create for this job at its current generation: object → its message."""
    kueue: KueueView | None = None
    """None when the operator's Kueue integration is off."""
    scope: PassScope = PassScope.FULL
    """BARRIER: nothing but acks changed since the last pass, which stepped the open barrier (the shell knows)."""
    taken: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Pods this job would create whose name another pod has, one not labelled as this job's: name → that pod's
    metadata as the API server returned it (with its managedFields)."""
    owners: dict[str, dict[str, Any]] = field(default_factory=dict)
    """The StatefulSets that own pods labelled as this job's, and the LeaderWorkerSets that own those, as read
    (kind and metadata), by UID: what the pods' owner chains lead through (lockstep.reconcile.ownership)."""
    group_set: dict[str, Any] | None = None
    """The LeaderWorkerSet of the job's actor groups' name, as read (with its managedFields); None when there is
    none (or the job has no groups)."""
    trainer_env: dict[str, str] = field(default_factory=dict)
    """Environment defaults of the trainer pods from the operator's own (its OTLP endpoint, lockstep.tracing); a
    variable of the same name in spec.trainer.env replaces the default."""


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass
class Plan:
    """What to do, in order: apply children, delete pods, create pods, write status, emit events."""

    status: RLJobStatus
    children: list[dict[str, Any]] = field(default_factory=list)
    delete_pods: dict[str, str] = field(default_factory=dict)  # pod name → why
    annotate_pods: dict[str, dict[str, str]] = field(default_factory=dict)  # pod name → annotations to set
    create_pods: list[dict[str, Any]] = field(default_factory=list)
    remove_children: list[tuple[str, str]] = field(default_factory=list)  # (kind, name) of children no longer wanted
    events: list[Event] = field(default_factory=list)
    requeue_after: float | None = None
    delete_job: bool = False
    waiting_for: set[str] | None = None
    """The members whose ack the open barrier's current phase still waits for; None when this pass did not step
    an open barrier (so acks alone ask for no pass of the barrier step alone)."""
    workload_status: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Kueue Workload name → a merge patch of its status (with the resourceVersion it was computed from)."""


class Next(Enum):
    """What a step tells the pipeline: go on to the next step, or the pass is done (the step said why)."""

    CONTINUE = "continue"
    DONE = "done"


def pod_phase(pod: dict[str, Any]) -> str:
    return str((pod.get("status") or {}).get("phase", "Pending"))


def pod_ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def role(pod: dict[str, Any]) -> str:
    return str(pod["metadata"]["labels"][keys.ROLE])


def annotation(pod: dict[str, Any], key: str) -> str | None:
    value = (pod["metadata"].get("annotations") or {}).get(key)
    return None if value is None else str(value)


class Pass:
    """One reconcile pass over one job: what was observed, and the plan its steps fill."""

    def __init__(self, observed: Observed) -> None:
        self.observed = observed
        metadata = observed.job["metadata"]
        self.job = desired.JobRef(metadata["name"], metadata["namespace"], metadata["uid"])
        self.generation: int | None = metadata.get("generation")
        self.now = rfc3339(observed.now)
        self.old = RLJobStatus.model_validate(observed.job.get("status") or {})
        status = self.old.model_copy(deep=True)
        status.observed_generation = self.generation
        self.plan = Plan(status=status)
        owners = ownership.Owners(observed.owners)
        by_uid = {str(p["metadata"].get("uid")): p for p in observed.pods}
        self.own_pods = [p for p in observed.pods if ownership.is_child(p, self.job, owners, by_uid)]
        """Every pod of the job's own (lockstep.reconcile.ownership), those being deleted included."""
        self.pods = {p["metadata"]["name"]: p for p in self.own_pods if not p["metadata"].get("deletionTimestamp")}
        """The job's own pods that are not being deleted, by name."""
        labelled = (p for p in observed.pods if not p["metadata"].get("deletionTimestamp"))
        self.squatters = {
            p["metadata"]["name"]: p
            for p in labelled
            if p["metadata"]["name"] not in self.pods and not ownership.awaiting_collection(p, owners)
        }
        """Pods that wear the job's labels but are not its children (nor left to the garbage collector): reported,
        never members, never written to."""
        self.updates_stalled: str | None = None
        """Why no weight update opens for the version the actors should load (lockstep.barrier.held_back), for
        Ready; None when none is stalled."""

    @property
    def status(self) -> RLJobStatus:
        return self.plan.status

    def condition(self, type_: str, ok: bool, reason: str, message: str) -> None:
        self.status.conditions = set_condition(
            self.status.conditions, type_, ok, reason, message, generation=self.generation, now=self.now
        )

    def event(self, reason: str, message: str, *, warning: bool = False) -> None:
        self.plan.events.append(Event("Warning" if warning else "Normal", reason, message))

    def requeue(self, seconds: float) -> None:
        """Ask for another pass in ``seconds`` (the soonest of what the steps ask for)."""
        self.plan.requeue_after = seconds if self.plan.requeue_after is None else min(self.plan.requeue_after, seconds)

    def stop_all_pods(self, spec: RLJobSpec, why: str) -> None:
        """Delete every pod by choice (the job is suspended, queued or finished): no restart is under way. A pod
        this pass already deletes keeps its reason. Actor groups go with their LeaderWorkerSet."""
        for name in self.pods:
            self.plan.delete_pods.setdefault(name, why)
        if spec.actors.group is not None:  # else LeaderWorkerSet creates the groups' pods again
            self.plan.remove_children.append((desired.LEADER_WORKER_SET, desired.actor_set_name(self.job.name)))
        self.status.restarting = []

    def replace(self, pods: dict[str, str]) -> None:
        """Delete ``pods`` (name → why) by the operator's own choice, to be recreated: a replacement, never
        counted against spec.maxRestarts. A trainer rank is never replaced alone: its torch.distributed group
        would fail without it, so the ranks are replaced together."""
        if any(role(self.pods[name]) == keys.TRAINER for name in pods):
            trainers = [name for name, pod in self.pods.items() if role(pod) == keys.TRAINER]
            why = "its torch.distributed group has a rank being replaced: the ranks restart together"
            pods = {**dict.fromkeys(trainers, why), **pods} if len(trainers) > 1 else pods
        for name, why in pods.items():
            if name in self.plan.delete_pods or name in self.status.replacing:
                continue
            self.plan.delete_pods[name] = why
            self.status.replacing.append(name)
            self.status.replacements += 1
