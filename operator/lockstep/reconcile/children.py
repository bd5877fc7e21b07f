"""The job's pods against the pods it should have, classified once per pass (as JobSet's controller does), so
that the steps after read one picture instead of each scanning the pods again."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lockstep import desired, keys
from lockstep.api import Phase
from lockstep.reconcile.context import Pass, annotation, pod_phase, role


@dataclass(frozen=True)
class Desired:
    """The pods the job should have: those the operator creates (its actors and trainers by name, and its
    preflight pod if enabled), and with spec.actors.group the LeaderWorkerSet and the pods it creates."""

    pods: dict[str, dict[str, Any]]
    preflight: dict[str, Any] | None
    group_set: dict[str, Any] | None = None
    groups: dict[str, dict[str, Any]] = field(default_factory=dict)
    """The pods of the actor groups by name (desired.group_pods)."""

    @property
    def all(self) -> list[dict[str, Any]]:
        """The pods the operator creates."""
        return [*self.pods.values(), *([self.preflight] if self.preflight else [])]

    @property
    def running(self) -> list[dict[str, Any]]:
        """Every pod the job runs, the groups' too (what Kueue admits as one gang)."""
        return [*self.all, *self.groups.values()]

    def leader_of(self, name: str) -> str:
        """The leader of the group pod ``name``: every pod of group i carries the index i."""
        index = int(self.groups[name]["metadata"]["labels"][keys.INDEX])
        return desired.pod_name(self.groups[name]["metadata"]["labels"][keys.JOB], keys.ACTOR, index)


@dataclass(frozen=True)
class Children:
    desired: Desired
    pods: dict[str, dict[str, Any]]
    """The actor and trainer pods that exist (not being deleted), by name; without the preflight pod."""
    preflight: dict[str, Any] | None
    """The preflight pod, if it exists and the job wants one."""
    rank0: dict[str, Any] | None
    failed: list[str]
    """Failed pods that no replacement or restart under way accounts for."""
    vanished: list[str]
    """Pods that ran when the job last ran and are gone, that no replacement or restart accounts for."""
    scaled_down: list[str]
    """Pods the spec no longer asks for."""
    drifted: dict[str, str]
    """Pods that run under another parity configuration than the job's: name → their fingerprint."""
    changed: list[str]
    """Pods whose spec differs from what the job asks for now."""
    missing: list[str]
    """Desired pods that do not exist."""
    groups: dict[str, dict[str, Any]]
    """The actor groups' pods that exist (LeaderWorkerSet's, not being deleted), by name. A drifted one names its
    group's leader in ``drifted``: the whole group is replaced."""


def classify(run: Pass, wanted: Desired, fingerprint: str) -> Children:
    """The pods the operator creates, against what it wants of them; the groups' pods, which LeaderWorkerSet creates,
    restarts and scales (a worker pod the spec no longer asks for is LeaderWorkerSet's to delete), only for drift."""
    preflight_name = wanted.preflight["metadata"]["name"] if wanted.preflight else None
    groups = {name: pod for name, pod in run.pods.items() if name in wanted.groups}
    pods = {
        name: pod
        for name, pod in run.pods.items()
        if name != preflight_name and name not in groups and role(pod) != keys.ACTOR_WORKER
    }
    accounted = set(run.status.replacing) | set(run.status.restarting)
    drifted: dict[str, str] = {}
    changed: list[str] = []
    for name, pod in groups.items():
        leader = wanted.leader_of(name)
        if annotation(pod, keys.CONFIG_FINGERPRINT) != fingerprint and leader in groups:
            drifted.setdefault(leader, str(annotation(pod, keys.CONFIG_FINGERPRINT)))
    for name, pod in pods.items():
        target = wanted.pods.get(name)
        if target is None:
            continue
        if annotation(pod, keys.CONFIG_FINGERPRINT) != fingerprint:
            drifted[name] = str(annotation(pod, keys.CONFIG_FINGERPRINT))
        elif annotation(pod, keys.TEMPLATE_HASH) != annotation(target, keys.TEMPLATE_HASH):
            changed.append(name)
    return Children(
        desired=wanted,
        pods=pods,
        preflight=run.pods.get(preflight_name) if preflight_name else None,
        rank0=pods.get(desired.rank0_name(run.job.name)),
        failed=sorted(n for n, pod in pods.items() if pod_phase(pod) == "Failed" and n not in accounted),
        vanished=sorted(
            n for n, pod in wanted.pods.items() if n not in pods and n not in accounted and _was_running(run, pod)
        ),
        scaled_down=[name for name in pods if name not in wanted.pods],
        drifted=drifted,
        changed=changed,
        missing=[name for name in wanted.pods if name not in pods],
        groups=groups,
    )


def _was_running(run: Pass, pod: dict[str, Any]) -> bool:
    """Whether this pod was part of the job when it last ran (a later scale-up adds new indices)."""
    if run.old.phase is not Phase.RUNNING:
        return False
    previous = run.old.actors if role(pod) == keys.ACTOR else run.old.trainer
    return int(pod["metadata"]["labels"][keys.INDEX]) < previous.desired
