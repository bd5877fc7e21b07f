"""Which pod events need a reconcile pass: the operator's filter between its pod watch and its work queue.

Pure. A pass reads the job and its pods from the API server and may rewrite the status, so at 1024 actors a
pass per pod event was most of a barrier's cost. ``PodFacts`` is what a pass reads of a pod: an event that
changes none of it (the echo of the operator's own command write, a kubelet status heartbeat) needs no pass.
``AckGate`` is the open barrier as the last pass left it: while a barrier phase waits for acks, an ack that
answers it only shrinks the set of members still to answer; the pass runs when that set empties, when an
ack reports an error or cannot be read (a pass of the barrier step alone: ``PassScope.BARRIER``), or when
anything else about a pod changes (a member left, failed, was replaced: the whole pipeline). The phase deadline
is a timer of its own. ``PodCache`` is one job's pods as the watch delivered
them, so that a pass does not list them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

from lockstep import keys
from lockstep.protocol import ACK_FOR, Ack, BarrierPhase, parse_ack

JobKey = tuple[str, str]
"""A job's (namespace, name): what its passes, its pods and its gate are kept under."""


@dataclass(frozen=True)
class PodFacts:
    """What the reconciler reads of one pod."""

    uid: str
    phase: str
    ready: bool
    deleting: bool
    labels: tuple[tuple[str, str], ...]
    annotations: tuple[tuple[str, str], ...]
    """The lockstep.dev/ annotations, sorted."""

    @classmethod
    def of(cls, pod: dict[str, Any]) -> PodFacts:
        metadata, status = pod["metadata"], pod.get("status") or {}
        conditions = status.get("conditions") or []
        return cls(
            uid=metadata.get("uid", ""),
            phase=status.get("phase", "Pending"),
            ready=any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions),
            deleting=bool(metadata.get("deletionTimestamp")),
            labels=tuple(sorted((metadata.get("labels") or {}).items())),
            annotations=tuple(
                sorted((k, v) for k, v in (metadata.get("annotations") or {}).items() if k.startswith(keys.DOMAIN))
            ),
        )

    def annotation(self, key: str) -> str | None:
        return dict(self.annotations).get(key)

    def apart_from_ack(self) -> PodFacts:
        return replace(self, annotations=tuple(kv for kv in self.annotations if kv[0] != keys.BARRIER_ACK))


class AckVerdict(Enum):
    ANSWERS = "answers"
    """A valid ack of the current phase and try, without error: one member fewer to wait for."""
    NEEDS_PASS = "needs a pass"
    """An error, an ack that cannot be read, or the last one the phase waited for: the state machine decides."""
    IGNORED = "ignored"
    """Stale (another barrier, phase or try) or already counted: nothing to do."""


@dataclass
class AckGate:
    """An open barrier phase as the last pass left it, and the members whose ack it still waits for."""

    barrier_id: str
    phase: BarrierPhase
    retries: dict[str, int]
    waiting: set[str] = field(default_factory=set)

    def on_ack(self, pod: str, text: str | None) -> AckVerdict:
        """Judge a new ack on ``pod``, and stop waiting for it when it answers."""
        ack = parse_ack(text)
        if isinstance(ack, str):
            return AckVerdict.NEEDS_PASS
        if not isinstance(ack, Ack) or pod not in self.waiting:
            return AckVerdict.IGNORED
        if ack.id != self.barrier_id or ack.retry != self.retries.get(pod, 0):
            return AckVerdict.IGNORED
        if ack.error:
            return AckVerdict.NEEDS_PASS
        if ack.phase != ACK_FOR[self.phase]:
            return AckVerdict.IGNORED
        self.waiting.discard(pod)
        return AckVerdict.ANSWERS if self.waiting else AckVerdict.NEEDS_PASS


class PassScope(Enum):
    """How much of the pipeline a pass runs (lockstep.reconcile)."""

    FULL = "full"
    """Everything: the job, its policy, its children and its pods against the desired ones, then the barrier."""
    BARRIER = "barrier"
    """The barrier step alone: nothing but acks changed since the last pass, which stepped the open barrier."""

    def join(self, other: PassScope | None) -> PassScope:
        """One pass for two requests: the whole pipeline if either asks for it."""
        return PassScope.FULL if PassScope.FULL in (self, other) else PassScope.BARRIER


def pass_for(before: PodFacts | None, after: PodFacts | None, gate: AckGate | None, pod: str) -> PassScope | None:
    """The pass a pod event (``before`` → ``after``; None: unknown, or deleted) needs, if any."""
    if before == after:
        return None  # nothing a pass reads changed (e.g. the echo of the operator's own command)
    if before is None or after is None or before.apart_from_ack() != after.apart_from_ack():
        return PassScope.FULL
    if gate is None:
        return None  # acks matter to an open barrier only; the pass that opens one judges those already there
    verdict = gate.on_ack(pod, after.annotation(keys.BARRIER_ACK))
    return PassScope.BARRIER if verdict is AckVerdict.NEEDS_PASS else None


def revision(obj: dict[str, Any]) -> int | None:
    """The object's resourceVersion as a number (etcd's revision, which orders versions), None when it is not one."""
    text = obj["metadata"].get("resourceVersion", "")
    return int(text) if text.isdigit() else None


def _newer(version: int | None, than: int | None) -> bool:
    """Unless both are known, a version counts as newer: the latest delivered wins."""
    return version is None or than is None or version > than


def slim(pod: dict[str, Any]) -> dict[str, Any]:
    """What a pass reads of a pod, and what the cache keeps: its metadata (without managedFields) and status."""
    metadata = {key: value for key, value in pod["metadata"].items() if key != "managedFields"}
    return {"metadata": metadata, "status": pod.get("status") or {}}


@dataclass
class PodCache:
    """One job's pods, newest version of each, fed by the pod watch and by the operator's own writes; complete
    (``listed``) once a LIST has been merged in. Pods are kept slim and never changed in place, so a pass may
    read them without copying. Out-of-band versions (a LIST, a create's answer) arrive out of order with the
    watch; resourceVersions order them, and a deletion's revision is remembered so that an older version
    does not bring the pod back."""

    pods: dict[str, dict[str, Any]] = field(default_factory=dict)
    deleted: dict[str, int | None] = field(default_factory=dict)
    """Pod name → the revision at which it was seen deleted."""
    listed_at: int | None = None
    listed: bool = False

    def observe(self, event: str, pod: dict[str, Any]) -> None:
        """A version of a pod: from the watch (``event`` ADDED, MODIFIED or DELETED), a LIST or a write's answer."""
        name, version = pod["metadata"]["name"], revision(pod)
        kept = self.pods.get(name)
        if kept is not None and not _newer(version, revision(kept)) and version != revision(kept):
            return  # older than what is kept
        if kept is None and name in self.deleted and not _newer(version, self.deleted[name]):
            return  # a version from before its deletion
        if kept is None and self.listed_at is not None and not _newer(version, self.listed_at):
            return  # the LIST at a later revision did not have it: it was gone by then
        if event == "DELETED":
            self.pods.pop(name, None)
            self.deleted[name] = version
        else:
            self.pods[name] = slim(pod)
            self.deleted.pop(name, None)

    def merge_list(self, pods: list[dict[str, Any]], version: str) -> None:
        """Merge a LIST of the job's pods taken at ``version`` (its metadata.resourceVersion): the cache is
        complete from now on; a kept pod the LIST did not have, no newer than it, was deleted before it."""
        at = int(version) if version.isdigit() else None
        self.listed_at, self.listed = None, False
        for pod in pods:
            self.observe("ADDED", pod)
        names = {pod["metadata"]["name"] for pod in pods}
        for name in [n for n, kept in self.pods.items() if n not in names and not _newer(revision(kept), at)]:
            self.observe("DELETED", {"metadata": {**self.pods[name]["metadata"], "resourceVersion": version}})
        self.deleted = {name: rev for name, rev in self.deleted.items() if _newer(rev, at)}
        self.listed_at, self.listed = at, True

    def annotate(self, name: str, values: dict[str, str]) -> None:
        """The operator wrote ``values`` on the pod: keep them until the watch brings the written version."""
        kept = self.pods.get(name)
        if kept is not None:
            annotations = {**(kept["metadata"].get("annotations") or {}), **values}
            self.pods[name] = {**kept, "metadata": {**kept["metadata"], "annotations": annotations}}

    def deleting(self, name: str, at: str) -> None:
        """The operator asked for the pod's deletion at ``at`` (RFC 3339): a pass sees it leave at once."""
        kept = self.pods.get(name)
        if kept is not None and not kept["metadata"].get("deletionTimestamp"):
            self.pods[name] = {**kept, "metadata": {**kept["metadata"], "deletionTimestamp": at}}

    def facts(self, name: str) -> PodFacts | None:
        kept = self.pods.get(name)
        return None if kept is None else PodFacts.of(kept)
