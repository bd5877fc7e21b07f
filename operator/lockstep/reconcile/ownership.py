"""Which objects are a job's children: told by the owner chain (each link ``controller: true`` with the owner's UID),
never by labels or names (issue 46). A pod is the job's child when

- the operator made it: its controller is the RLJob (kind, name and UID); or
- LeaderWorkerSet's controller made it for the job: a group's leader is owned by the StatefulSet that the job's
  LeaderWorkerSet owns, and a worker by the StatefulSet that its group's leader owns (LeaderWorkerSet v0.9's
  chain), the LeaderWorkerSet's own controller being the RLJob.

Anything else that wears the job's labels is a squatter: named in a condition, never a member, never written to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lockstep import desired
from lockstep.api.shared import GROUP

STATEFUL_SET = "StatefulSet"


def controller_of(metadata: dict[str, Any]) -> dict[str, Any] | None:
    """The owner reference marked ``controller: true`` (an object has at most one), or None."""
    return next((ref for ref in metadata.get("ownerReferences") or [] if ref.get("controller") is True), None)


def made_by_job(metadata: dict[str, Any], job: desired.JobRef) -> bool:
    """Whether the object's controller is the RLJob ``job`` itself (of any version of Lockstep's API)."""
    ref = controller_of(metadata)
    return ref is not None and (
        str(ref.get("apiVersion")).split("/")[0],
        ref.get("kind"),
        ref.get("name"),
        ref.get("uid"),
    ) == (GROUP, "RLJob", job.name, job.uid)


@dataclass(frozen=True)
class Owners:
    """What the pods' owner chains lead through: the StatefulSets that own pods labelled as the job's, and the
    LeaderWorkerSets that own those, each as read (metadata with its UID and ownerReferences), by UID."""

    by_uid: dict[str, dict[str, Any]]

    def owner(self, ref: dict[str, Any], kind: str) -> dict[str, Any] | None:
        """The object ``ref`` names, if it was read, is of ``kind`` and has the UID and name ``ref`` says."""
        found = self.by_uid.get(str(ref.get("uid")))
        if found is None or ref.get("kind") != kind or found.get("kind") != kind:
            return None
        return found if found["metadata"].get("name") == ref.get("name") else None


def is_child(pod: dict[str, Any], job: desired.JobRef, owners: Owners, pods_by_uid: dict[str, dict[str, Any]]) -> bool:
    """Whether ``pod`` is a child of ``job`` (the module's rule); ``pods_by_uid``: the pods labelled as the job's."""
    if made_by_job(pod["metadata"], job):
        return True
    owner = _stateful_set(pod, owners)
    if owner is None:
        return False
    ref = controller_of(owner["metadata"]) or {}
    if ref.get("kind") == desired.LEADER_WORKER_SET:
        return _job_group_set(ref, job, owners)
    if ref.get("kind") == "Pod":  # a worker StatefulSet, owned by its group's leader
        leader = pods_by_uid.get(str(ref.get("uid")))
        if leader is None or leader["metadata"].get("name") != ref.get("name"):
            return False
        leaders_set = _stateful_set(leader, owners)
        return leaders_set is not None and _job_group_set(controller_of(leaders_set["metadata"]) or {}, job, owners)
    return False


def awaiting_collection(pod: dict[str, Any], owners: Owners) -> bool:
    """Whether ``pod``'s controller is a StatefulSet that is gone (not read under the UID its reference names): the
    garbage collector deletes such a pod, as when LeaderWorkerSet makes a group's StatefulSet anew. Never a child,
    and not worth a condition."""
    ref = controller_of(pod["metadata"])
    return ref is not None and ref.get("kind") == STATEFUL_SET and str(ref.get("uid")) not in owners.by_uid


def _stateful_set(pod: dict[str, Any], owners: Owners) -> dict[str, Any] | None:
    ref = controller_of(pod["metadata"])
    return None if ref is None or ref.get("apiVersion") != "apps/v1" else owners.owner(ref, STATEFUL_SET)


def _job_group_set(ref: dict[str, Any], job: desired.JobRef, owners: Owners) -> bool:
    """Whether ``ref`` names the job's own LeaderWorkerSet, whose controller is the RLJob."""
    group_set = owners.owner(ref, desired.LEADER_WORKER_SET)
    return (
        group_set is not None
        and group_set["metadata"].get("name") == desired.actor_set_name(job.name)
        and made_by_job(group_set["metadata"], job)
    )


def whose(metadata: dict[str, Any], owners: Owners) -> str:
    """Who owns an object that is not the job's, as far as its owner chain was read: 'StatefulSet x (owned by
    nobody)'; the managers that wrote it, when its managedFields came along."""
    chain: list[str] = []
    current: dict[str, Any] | None = metadata
    while current is not None and len(chain) < 3:
        ref = controller_of(current) or next(iter(current.get("ownerReferences") or []), None)
        if ref is None:
            chain.append("nobody")
            break
        chain.append(f"{ref.get('kind')} {ref.get('name')} (uid {ref.get('uid')})")
        found = owners.by_uid.get(str(ref.get("uid")))
        current = None if found is None else found["metadata"]
    managers = list(dict.fromkeys(str(entry.get("manager", "?")) for entry in metadata.get("managedFields") or []))
    written = f", written by {', '.join(managers)}" if managers else ""
    return f"owned by {', owned by '.join(chain)}{written}"
