"""The RLJob reconciler's functional core: what the operator read → what it should do.

``reconcile`` is pure. The kopf shell (lockstep.controller) lists the job's pods, the
ParityPolicies and the namespace's labels, calls it, and carries out the returned Plan.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from lockstep import barrier, desired, keys
from lockstep.api import (
    BudgetAction,
    Enforcement,
    Mismatch,
    ParityPolicy,
    Phase,
    PreflightResult,
    ReplicaStatus,
    RLJobSpec,
    RLJobStatus,
    Weights,
)
from lockstep.conditions import PARITY_DEGRADED, PARITY_LOCKED, READY, RECONCILING, STALLED, find, set_condition
from lockstep.parity import EffectiveConfig, PolicyError, effective_config, select_policy
from lockstep.times import parse_rfc3339, rfc3339

MAX_BACKOFF_SECONDS = 300.0
FINISHED = (Phase.SUCCEEDED, Phase.FAILED)
# Condition reasons whose transition Event is a Warning even though the condition is True, and
# False ones that are ordinary progress rather than trouble.
WARNING_REASONS = frozenset({"LockedValuesApplied", "MismatchBudgetExceeded"})
BENIGN_REASONS = frozenset({"PodsNotReady", "Suspended", "WithinBudget"})
# Ready=False reasons that need a person (fix the spec or the policy, or recreate the job): Stalled, for kstatus.
STALLED_REASONS = frozenset(
    {
        "InvalidSpec",
        "ConflictsWithPolicy",
        "PolicyNotFound",
        "NoDefaultPolicy",
        "AmbiguousDefaultPolicy",
        "PolicyNotApplicable",
        "RestartLimitExceeded",
        "WeightUpdateFailed",
        "MismatchBudgetExceeded",
        "PreflightFailed",
    }
)


def restart_backoff_seconds(restarts: int, base: float = 10.0) -> float:
    """Wait before recreating pods after the n-th restart: base, 2·base, 4·base, ... capped at 5 minutes."""
    return min(base * 2.0 ** max(restarts - 1, 0), MAX_BACKOFF_SECONDS)


@dataclass(frozen=True)
class Observed:
    """What the operator read from the API server for one RLJob."""

    job: dict[str, Any]
    pods: list[dict[str, Any]]
    policies: list[dict[str, Any]]
    namespace_labels: dict[str, str]
    now: dt.datetime
    backoff_base_seconds: float = 10.0


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
    events: list[Event] = field(default_factory=list)
    requeue_after: float | None = None
    delete_job: bool = False


def pod_phase(pod: dict[str, Any]) -> str:
    return str((pod.get("status") or {}).get("phase", "Pending"))


def pod_ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _role(pod: dict[str, Any]) -> str:
    return str(pod["metadata"]["labels"][keys.ROLE])


def _annotation(pod: dict[str, Any], key: str) -> str | None:
    value = (pod["metadata"].get("annotations") or {}).get(key)
    return None if value is None else str(value)


class _Reconciler:
    """One reconcile pass; methods fill ``self.plan``."""

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
        self.pods = {p["metadata"]["name"]: p for p in observed.pods if not p["metadata"].get("deletionTimestamp")}

    @property
    def status(self) -> RLJobStatus:
        return self.plan.status

    def condition(self, type_: str, ok: bool, reason: str, message: str) -> None:
        self.status.conditions = set_condition(
            self.status.conditions, type_, ok, reason, message, generation=self.generation, now=self.now
        )

    def event(self, reason: str, message: str, *, warning: bool = False) -> None:
        self.plan.events.append(Event("Warning" if warning else "Normal", reason, message))

    def delete_all_pods(self, why: str) -> None:
        for name in self.pods:
            self.plan.delete_pods[name] = why

    # -- the pass ------------------------------------------------------------------------

    def run(self) -> Plan:
        try:
            spec = RLJobSpec.model_validate(self.observed.job.get("spec") or {})
        except ValidationError as error:
            self.condition(READY, False, "InvalidSpec", f"the RLJob spec is invalid: {error}")
            return self.finish()
        if self.status.phase in FINISHED:
            self.delete_all_pods(f"the job {self.status.phase.value.lower()}")
            self.expire(spec)
            return self.finish()
        config = self.resolve_parity(spec)
        if config is None:
            return self.finish()
        wanted = {p["metadata"]["name"]: p for p in desired.pods(self.job, spec, config)}
        preflight = desired.preflight_pod(self.job, spec, config) if spec.preflight.enabled else None
        self.plan.children = [
            *desired.worker_access(self.job, [*wanted, *([preflight["metadata"]["name"]] if preflight else [])]),
            desired.config_map(self.job, config),
            *desired.services(self.job),
        ]
        if spec.suspend:
            self.delete_all_pods("the job is suspended")
            self.status.phase = Phase.SUSPENDED
            self.condition(READY, False, "Suspended", "spec.suspend is true: pods are deleted, the status is kept")
            self.count(spec, {})
            return self.finish()
        if preflight is not None and not self.run_preflight(spec, config, preflight):
            return self.finish()
        self.run_pods(spec, config, wanted)
        return self.finish()

    def resolve_parity(self, spec: RLJobSpec) -> EffectiveConfig | None:
        """Set ParityLocked; return the effective config, or None when the job may not run."""
        meta = self.observed.job["metadata"]
        try:
            policies = [ParityPolicy.model_validate(p) for p in self.observed.policies]
            policy = select_policy(spec.parity_policy, policies, meta["namespace"], self.observed.namespace_labels)
        except PolicyError as error:
            message = str(error)
            if self.pods:
                message += (
                    f"; the {len(self.pods)} existing pods keep running with the last applied configuration "
                    f"({self.status.config_fingerprint}) and no new pods are created"
                )
            self.condition(PARITY_LOCKED, False, error.reason, message)
            self.condition(READY, False, error.reason, message)
            return None
        config = effective_config(spec, policy)
        self.status.parity_policy = config.policy
        conflicts = "; ".join(c.describe() for c in config.conflicts)
        if config.refused:
            message = (
                f"ParityPolicy {config.policy!r} (Enforce) locks keys this job sets otherwise: {conflicts}. "
                "Remove them from spec.actors.vllm or set them to the locked values; no pods run until then"
            )
            self.delete_all_pods("the job conflicts with its ParityPolicy")
            self.status.phase = Phase.PENDING
            self.condition(PARITY_LOCKED, False, "ConflictsWithPolicy", message)
            self.condition(READY, False, "ConflictsWithPolicy", message)
            self.count(spec, {})
            return None
        if not config.conflicts:
            self.condition(PARITY_LOCKED, True, "Locked", f"vLLM settings locked by ParityPolicy {config.policy!r}")
        elif config.enforcement is Enforcement.WARN:
            message = (
                f"ParityPolicy {config.policy!r} (Warn) overrode: {conflicts}; the pods run with the locked values"
            )
            self.condition(PARITY_LOCKED, True, "LockedValuesApplied", message)
        else:
            self.condition(
                PARITY_LOCKED,
                False,
                "AuditOnly",
                f"ParityPolicy {config.policy!r} (Audit) records that this job differs: {conflicts}; "
                "the pods run with the job's own values",
            )
        self.status.config_fingerprint = config.fingerprint
        return config

    def run_preflight(self, spec: RLJobSpec, config: EffectiveConfig, pod: dict[str, Any]) -> bool:
        """Run the preflight pod and judge what it measured; True once it passed (training may start)."""
        name = pod["metadata"]["name"]
        found = self.pods.pop(name, None)  # not a training pod: the passes below never see it
        if self.status.preflight is not None:
            if found is not None:
                self.plan.delete_pods[name] = "the preflight check finished"
            return True
        if found is None:
            self.plan.create_pods = [pod]
        phase = pod_phase(found) if found else "Pending"
        if phase == "Failed":
            self.finish_job(spec, Phase.FAILED, "PreflightFailed", f"the preflight pod {name} failed; see its log")
            self.plan.delete_pods[name] = "the preflight check failed"
            return False
        if phase != "Succeeded":
            self.status.phase = Phase.PENDING
            self.condition(
                READY, False, "Preflight", f"pod {name} is checking train-inference parity before training starts"
            )
            return False
        assert found is not None
        self.plan.delete_pods[name] = "the preflight check finished"
        result = barrier.read_document(_annotation(found, keys.PREFLIGHT), PreflightResult)
        if not isinstance(result, PreflightResult):
            why = result or "wrote no result"
            self.finish_job(spec, Phase.FAILED, "PreflightFailed", f"the preflight pod {name} {why}")
            return False
        self.status.preflight = result
        budget = config.mismatch_budget.mean_abs_logprob_diff
        worst = max(result.mean_abs_logprob_diff, result.shared_prefix_mean_abs_logprob_diff)
        numbers = (
            f"mean |Δlogprob| {result.mean_abs_logprob_diff:.3g}, after an in-flight update with shared prompts "
            f"{result.shared_prefix_mean_abs_logprob_diff:.3g}, clip fraction {result.clip_fraction:.3g} over "
            f"{result.tokens} tokens; budget {budget:.3g} (ParityPolicy {config.policy!r})"
        )
        if worst > budget:
            message = f"the preflight parity check is over budget: {numbers}"
            self.finish_job(spec, Phase.FAILED, "MismatchBudgetExceeded", message)
            self.condition(PARITY_LOCKED, False, "MismatchBudgetExceeded", message)
            return False
        self.event("PreflightPassed", f"the preflight parity check passed: {numbers}")
        return True

    def run_pods(self, spec: RLJobSpec, config: EffectiveConfig, wanted: dict[str, dict[str, Any]]) -> None:
        rank0 = self.pods.get(desired.pod_name(self.job.name, keys.TRAINER, 0))
        if rank0 is not None and pod_phase(rank0) == "Succeeded":
            self.finish_training(spec, config, rank0)
            return
        if self.handle_losses(spec, wanted):
            return
        for name, pod in self.pods.items():
            target = wanted.get(name)
            if target is None:
                self.plan.delete_pods[name] = "no longer desired (scaled down)"
            elif _annotation(pod, keys.CONFIG_FINGERPRINT) != config.fingerprint:
                self.plan.delete_pods[name] = "it ran under another parity configuration (drift)"
                self.condition(
                    PARITY_LOCKED,
                    False,
                    "Drift",
                    f"pod {name} runs with config {_annotation(pod, keys.CONFIG_FINGERPRINT)}, not "
                    f"{config.fingerprint}; replacing it",
                )
            elif _annotation(pod, keys.TEMPLATE_HASH) != _annotation(target, keys.TEMPLATE_HASH):
                self.plan.delete_pods[name] = "the pod spec changed"
        # Pods deleted in this pass are recreated in a later one, once they are gone.
        missing = [pod for name, pod in wanted.items() if name not in self.pods]
        replaced = [name for name in wanted if name in self.plan.delete_pods]
        wait = self.backoff_remaining()
        if wait <= 0:
            self.plan.create_pods = [self.with_initial_weights(pod) for pod in missing]
        elif missing or replaced:
            self.plan.requeue_after = wait
        live = {name: pod for name, pod in self.pods.items() if name not in self.plan.delete_pods and name in wanted}
        if self.run_barrier(spec, config, live, hold=self.check_parity(config, rank0)):
            return
        self.count(spec, live)
        if self.status.actors.ready == spec.actors.replicas and self.status.trainer.ready == spec.trainer.replicas:
            self.status.phase = Phase.RUNNING
            self.condition(READY, True, "AllPodsReady", self.readiness_message())
        else:
            if self.old.phase is not Phase.RUNNING:
                self.status.phase = Phase.PENDING
            ready = find(self.status.conditions, READY)
            if ready is None or ready.reason != "Restarting" or wait <= 0:
                self.condition(READY, False, "PodsNotReady", self.readiness_message())

    def finish_training(self, spec: RLJobSpec, config: EffectiveConfig, rank0: dict[str, Any]) -> None:
        """Rank 0 has completed: carry its last announced weights to every actor (unless the ParityPolicy
        holds weight updates), then succeed."""
        if self.run_barrier(spec, config, self.pods, hold=self.check_parity(config, rank0)):
            return
        announced = barrier.announced_by(rank0)
        final = announced.version if isinstance(announced, Weights) else None
        committed = self.status.weights_version
        if self.status.barrier is None and (final is None or (committed or 0) >= final):
            serving = f"; every actor serves weights version {committed}" if committed else ""
            self.finish_job(spec, Phase.SUCCEEDED, "TrainerSucceeded", f"the trainer (rank 0) completed{serving}")
            return
        self.condition(
            READY, True, "FinalWeightUpdate", f"the trainer completed; carrying weights version {final} to every actor"
        )

    def with_initial_weights(self, pod: dict[str, Any]) -> dict[str, Any]:
        """A new pod starts from the committed weights (it joins a catch-up barrier if newer ones are in flight)."""
        if self.status.weights is not None:
            pod["metadata"]["annotations"][keys.INITIAL_WEIGHTS] = barrier.document(self.status.weights)
        return pod

    def check_parity(self, config: EffectiveConfig, rank0: dict[str, Any] | None) -> bool:
        """Hold the trainer's last parity measurement against the ParityPolicy's budget (ParityDegraded);
        True when the policy says to hold weight updates meanwhile."""
        measured = barrier.read_document(_annotation(rank0, keys.MISMATCH) if rank0 else None, Mismatch)
        if isinstance(measured, Mismatch) and measured.token_fraction > 0:
            self.status.mismatch = measured
        last = self.status.mismatch
        if last is None:
            return False
        budget = config.mismatch_budget
        numbers = (
            f"step {last.step}: mean |Δlogprob| {last.mean_abs_logprob_diff:.3g} between the trainer and the actors "
            f"on {last.token_fraction:.0%} of its tokens; budget {budget.mean_abs_logprob_diff:.3g} "
            f"(ParityPolicy {config.policy!r})"
        )
        if last.mean_abs_logprob_diff <= budget.mean_abs_logprob_diff:
            self.condition(PARITY_DEGRADED, False, "WithinBudget", numbers)
            return False
        hold = budget.on_exceeded is BudgetAction.PAUSE
        advice = (
            "; weight updates are held (onExceeded: Pause) until a measurement is within the budget: fix the "
            "configuration or raise trainer.mismatchBudget in the ParityPolicy"
            if hold
            else ""
        )
        self.condition(PARITY_DEGRADED, True, "MismatchBudgetExceeded", f"over budget at {numbers}{advice}")
        return hold

    def run_barrier(
        self, spec: RLJobSpec, config: EffectiveConfig, live: dict[str, dict[str, Any]], *, hold: bool = False
    ) -> bool:
        """Advance the weight-update barrier (open none while ``hold``); True when it failed the job. With a
        collective backend trainer rank 0 is a member too: it sends the weights."""
        rank0_name = desired.pod_name(self.job.name, keys.TRAINER, 0)
        collective = spec.weight_sync.backend.collective
        members = {
            name: barrier.member_of(pod, reads_initial_weights=not collective)
            for name, pod in live.items()
            if (_role(pod) == keys.ACTOR or (collective and name == rank0_name)) and pod_phase(pod) == "Running"
        }
        rank0 = live.get(rank0_name)
        announced = barrier.announced_by(rank0) if rank0 is not None else None
        if isinstance(announced, str):
            self.event("InvalidWeightsAnnouncement", f"{keys.WEIGHTS} on the trainer {announced}", warning=True)
            announced = None
        decision = barrier.step(
            job_uid=self.job.uid,
            barrier=self.status.barrier,
            committed=self.status.weights,
            announced=None if hold and self.status.barrier is None else announced,
            members=list(members.values()),
            history=self.status.barrier_history,
            now=self.observed.now,
            timeout_seconds=spec.weight_sync.barrier_timeout_seconds,
            on_timeout=spec.weight_sync.on_timeout,
            sender=rank0_name if collective else None,
            ranks_per_member=int(config.vllm.get("tensorParallelSize", 1)),
        )
        self.status.barrier = decision.barrier
        self.status.weights = decision.committed
        self.status.weights_version = decision.committed.version if decision.committed else None
        self.status.barrier_history = barrier.remember(self.status.barrier_history, decision.record)
        actors = [m.loaded_version or 0 for name, m in members.items() if _role(live[name]) == keys.ACTOR]
        self.status.lag = announced.version - min(actors) if announced is not None and actors else None
        for note in decision.notes:
            self.event("WeightUpdate", note)
        for name, command in decision.commands.items():
            text = barrier.document(command)
            if _annotation(live[name], keys.BARRIER) != text:
                self.plan.annotate_pods[name] = {keys.BARRIER: text}
        for name in decision.evict:
            self.plan.delete_pods[name] = "it was evicted from the weight update as a straggler"
        if decision.failed:
            self.finish_job(spec, Phase.FAILED, "WeightUpdateFailed", decision.failed)
            return True
        if decision.barrier is not None and decision.commands:
            deadline = parse_rfc3339(decision.barrier.deadline)
            self.requeue((deadline - self.observed.now).total_seconds() + 0.5)
        return False

    def requeue(self, seconds: float) -> None:
        self.plan.requeue_after = seconds if self.plan.requeue_after is None else min(self.plan.requeue_after, seconds)

    def handle_losses(self, spec: RLJobSpec, wanted: dict[str, dict[str, Any]]) -> bool:
        """Count failed or vanished pods as one restart; return True when the job failed for good."""
        failed = sorted(name for name, pod in self.pods.items() if pod_phase(pod) == "Failed")
        vanished = sorted(name for name, pod in wanted.items() if name not in self.pods and self.was_running(pod))
        for name in failed:
            self.plan.delete_pods[name] = "it failed"
        lost = failed + vanished
        if spec.trainer.replicas > 1 and any(_role(wanted.get(n) or self.pods[n]) == keys.TRAINER for n in lost):
            for name, pod in self.pods.items():
                if _role(pod) == keys.TRAINER and name not in self.plan.delete_pods:
                    self.plan.delete_pods[name] = "its torch.distributed group lost a rank: the ranks restart together"
        ready = find(self.old.conditions, READY)
        if not lost or (ready is not None and ready.reason == "Restarting"):
            return False
        self.status.restarts += 1
        self.status.last_restart_time = self.now
        what = f"pod(s) {', '.join(lost)} failed or were deleted"
        if self.status.restarts > spec.max_restarts:
            self.finish_job(
                spec,
                Phase.FAILED,
                "RestartLimitExceeded",
                f"{what}; the job already restarted {spec.max_restarts} time(s) (spec.maxRestarts)",
            )
            return True
        delay = restart_backoff_seconds(self.status.restarts, self.observed.backoff_base_seconds)
        message = f"{what}; restart {self.status.restarts} of {spec.max_restarts} in {delay:.0f}s"
        self.condition(READY, False, "Restarting", message)
        self.event("Restarting", message, warning=True)
        return False

    def was_running(self, pod: dict[str, Any]) -> bool:
        """Whether this pod was part of the job when it last ran (a later scale-up adds new indices)."""
        if self.old.phase is not Phase.RUNNING:
            return False
        labels = pod["metadata"]["labels"]
        previous = self.old.actors if labels[keys.ROLE] == keys.ACTOR else self.old.trainer
        return int(labels[keys.INDEX]) < previous.desired

    def backoff_remaining(self) -> float:
        ready = find(self.status.conditions, READY)
        if ready is None or ready.reason != "Restarting" or self.status.last_restart_time is None:
            return 0.0
        delay = restart_backoff_seconds(self.status.restarts, self.observed.backoff_base_seconds)
        elapsed = (self.observed.now - parse_rfc3339(self.status.last_restart_time)).total_seconds()
        return max(delay - elapsed, 0.0)

    def finish_job(self, spec: RLJobSpec, phase: Phase, reason: str, message: str) -> None:
        self.status.phase = phase
        self.status.finished_time = self.now
        self.delete_all_pods(f"the job {phase.value.lower()}")
        self.condition(READY, phase is Phase.SUCCEEDED, reason, message)
        self.count(spec, {})
        self.expire(spec)

    def expire(self, spec: RLJobSpec) -> None:
        """Honour ttlSecondsAfterFinished."""
        if spec.ttl_seconds_after_finished is None or self.status.finished_time is None:
            return
        expires = parse_rfc3339(self.status.finished_time) + dt.timedelta(seconds=spec.ttl_seconds_after_finished)
        remaining = (expires - self.observed.now).total_seconds()
        if remaining <= 0:
            self.plan.delete_job = True
        else:
            self.plan.requeue_after = remaining

    def count(self, spec: RLJobSpec, live: dict[str, dict[str, Any]]) -> None:
        def replicas(role: str, wanted: int) -> ReplicaStatus:
            ready = sum(1 for p in live.values() if _role(p) == role and pod_ready(p))
            return ReplicaStatus(desired=wanted, ready=ready, summary=f"{ready}/{wanted}")

        self.status.actors = replicas(keys.ACTOR, spec.actors.replicas)
        self.status.trainer = replicas(keys.TRAINER, spec.trainer.replicas)

    def readiness_message(self) -> str:
        return f"{self.status.actors.summary} actors and {self.status.trainer.summary} trainer pods ready"

    def summarize_for_gitops(self) -> None:
        """Stalled and Reconciling, as kstatus reads them: both follow from Ready (so no Events of their own)."""
        ready = find(self.status.conditions, READY)
        if ready is None:
            return
        stalled = ready.status.value == "False" and ready.reason in STALLED_REASONS
        reconciling = ready.status.value == "False" and not stalled and ready.reason != "Suspended"
        self.condition(STALLED, stalled, ready.reason if stalled else "NotStalled", ready.message if stalled else "")
        self.condition(
            RECONCILING,
            reconciling,
            ready.reason if reconciling else "Reconciled",
            ready.message if reconciling else "",
        )

    def finish(self) -> Plan:
        """Add an Event for each phase or condition transition."""
        if self.status.phase != self.old.phase:
            self.event(f"Phase{self.status.phase.value}", f"phase {self.old.phase.value} → {self.status.phase.value}")
        for condition in self.status.conditions:
            before = find(self.old.conditions, condition.type)
            if before is None or (before.status, before.reason) != (condition.status, condition.reason):
                warning = condition.reason in WARNING_REASONS or (
                    condition.status.value == "False" and condition.reason not in BENIGN_REASONS
                )
                message = f"{condition.type}={condition.status.value}: {condition.message}"
                self.event(condition.reason, message, warning=warning)
        self.summarize_for_gitops()
        if self.plan.create_pods:
            names = [p["metadata"]["name"] for p in self.plan.create_pods]
            self.event("CreatingPods", f"creating {len(names)} pod(s): {_abbreviate(names)}")
        for why in sorted(set(self.plan.delete_pods.values())):
            names = [n for n, w in self.plan.delete_pods.items() if w == why]
            self.event("DeletingPods", f"deleting {len(names)} pod(s) because {why}: {_abbreviate(names)}")
        return self.plan


def _abbreviate(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown} and {len(names) - limit} more"


def reconcile(observed: Observed) -> Plan:
    """Decide what the operator does for one RLJob, given what it read."""
    return _Reconciler(observed).run()
