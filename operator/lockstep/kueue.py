"""Kueue's functional core: an RLJob as one Kueue Workload, a gang of its actor, trainer and preflight pods.

The operator drives Kueue's Workload API itself, as Kueue's own job integrations do for their kinds (Kueue lists
RLJob among its ``integrations.externalFrameworks``). A job labelled ``kueue.x-k8s.io/queue-name`` gets one Workload
with a pod set per role (the pods' real resource requests). Its pods are held until Kueue admits the Workload, and
then carry the admitted ResourceFlavors' node labels and tolerations. When Kueue evicts the Workload (preemption, a
stopped queue, ``spec.suspend``), the pods are deleted, the status and committed weights are kept, and once no pod is
left running (a pod being deleted holds its devices until it stops) the quota is handed back; when the job ends, the
Workload is marked Finished, once no pod is left running either.

Every function is pure: lockstep.reconcile calls them with what the shell read.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lockstep import keys
from lockstep.desired import JobRef, Placement

GROUP = "kueue.x-k8s.io"
VERSION = "v1beta2"
API_VERSION = f"{GROUP}/{VERSION}"
WORKLOADS = "workloads"
RESOURCE_FLAVORS = "resourceflavors"
PRIORITY_CLASSES = "workloadpriorityclasses"
WORKLOAD = "Workload"
QUEUE_LABEL = f"{GROUP}/queue-name"
"""On an RLJob: the LocalQueue (in the job's namespace) it waits in."""
PRIORITY_LABEL = f"{GROUP}/priority-class"
"""On an RLJob: the WorkloadPriorityClass of its Workload."""
FRAMEWORK = "RLJob.v1alpha1.lockstep.dev"
"""How Kueue's configuration names RLJob under integrations.externalFrameworks (Kind.version.group)."""

# Workload condition types (Kueue's API).
QUOTA_RESERVED = "QuotaReserved"
ADMITTED = "Admitted"
EVICTED = "Evicted"
FINISHED = "Finished"
REQUEUED = "Requeued"
REQUEUING_REASONS = frozenset({"Preempted", "NodeFailures"})
"""Evictions after which Kueue queues the Workload again at once (as its own job integrations report them)."""

POD_TEMPLATE_FIELDS = ("nodeSelector", "tolerations", "affinity", "priorityClassName", "overhead")
"""What of a pod's spec Kueue reads to place and count it, beside its containers' resources."""


def queue_name(job: Mapping[str, Any]) -> str | None:
    """The LocalQueue the job asks for, or None when Kueue does not manage it."""
    return (job["metadata"].get("labels") or {}).get(QUEUE_LABEL) or None


def priority_class_name(job: Mapping[str, Any]) -> str | None:
    return (job["metadata"].get("labels") or {}).get(PRIORITY_LABEL) or None


def pod_sets(pods: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One pod set per role, in the order the roles first appear: its pod count and what Kueue reads of the pods'
    template (containers' resources, node selector, tolerations, affinity), so that only changes to those make a
    new Workload."""
    sets: dict[str, dict[str, Any]] = {}
    for pod in pods:
        role = pod["metadata"]["labels"][keys.ROLE]
        if role in sets:
            sets[role]["count"] += 1
            continue
        spec = pod["spec"]
        template = {field: spec[field] for field in POD_TEMPLATE_FIELDS if spec.get(field)}
        template["containers"] = [
            {"name": c["name"], "resources": c.get("resources") or {}} for c in spec["containers"]
        ]
        template["restartPolicy"] = spec.get("restartPolicy", "Never")
        sets[role] = {"name": role, "count": 1, "template": {"spec": template}}
    return list(sets.values())


def workload_name(job: JobRef, sets: Sequence[Mapping[str, Any]]) -> str:
    """Named after the job and its pod sets, which Kueue never lets change: other pod sets, another Workload."""
    digest = hashlib.sha256(json.dumps(list(sets), sort_keys=True).encode()).hexdigest()[:8]
    return f"rljob-{job.name}-{digest}"


@dataclass(frozen=True)
class Priority:
    """A WorkloadPriorityClass the job names, and its value."""

    name: str
    value: int


def workload(
    job: JobRef, queue: str, pods: Sequence[Mapping[str, Any]], *, active: bool, priority: Priority | None
) -> dict[str, Any]:
    """The Workload for ``pods`` (every pod the job runs while admitted), waiting in LocalQueue ``queue``.
    ``active`` false (spec.suspend) makes Kueue evict it and keep it from being admitted."""
    sets = pod_sets(pods)
    spec: dict[str, Any] = {"queueName": queue, "podSets": sets, "active": active}
    if priority is not None:
        spec["priorityClassRef"] = {"group": GROUP, "kind": "WorkloadPriorityClass", "name": priority.name}
        spec["priority"] = priority.value
    return {
        "apiVersion": API_VERSION,
        "kind": WORKLOAD,
        "metadata": job.metadata(workload_name(job, sets)),
        "spec": spec,
    }


def priority(job: Mapping[str, Any], classes: Mapping[str, Mapping[str, Any]]) -> Priority | None:
    """The job's WorkloadPriorityClass (``classes``: by name). Raises LookupError naming the missing class."""
    name = priority_class_name(job)
    if name is None:
        return None
    found = classes.get(name)
    if found is None:
        raise LookupError(
            f"the WorkloadPriorityClass {name!r} (label {PRIORITY_LABEL}) does not exist; create it, or remove the "
            "label for the queue's default priority"
        )
    return Priority(name, int(found["value"]))


# -- what Kueue decided --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Waiting:
    """Not admitted: Kueue's reason and message (an unadmitted Workload, or one Kueue has not seen yet)."""

    reason: str
    message: str


@dataclass(frozen=True)
class Admitted:
    cluster_queue: str
    flavors: dict[str, dict[str, str]]
    """Pod set → resource → the ResourceFlavor admitted for it."""


@dataclass(frozen=True)
class Evicting:
    """Kueue evicted the Workload while it still holds quota: stop the pods, then hand the quota back."""

    reason: str
    message: str


State = Waiting | Admitted | Evicting


def _condition(workload: Mapping[str, Any], type_: str) -> Mapping[str, Any] | None:
    conditions = (workload.get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c.get("type") == type_), None)


def _true(workload: Mapping[str, Any], type_: str) -> bool:
    found = _condition(workload, type_)
    return found is not None and found.get("status") == "True"


def state(workload: Mapping[str, Any] | None) -> State:
    """What Kueue decided about ``workload`` (None: not created yet)."""
    if workload is None:
        return Waiting("WorkloadCreated", "the operator creates the job's Workload")
    evicted = _condition(workload, EVICTED)
    if _true(workload, EVICTED) and _true(workload, QUOTA_RESERVED):
        assert evicted is not None
        return Evicting(str(evicted.get("reason", "Evicted")), str(evicted.get("message", "")))
    admission = (workload.get("status") or {}).get("admission")
    if _true(workload, ADMITTED) and admission:
        flavors = {str(a["name"]): dict(a.get("flavors") or {}) for a in admission.get("podSetAssignments") or []}
        return Admitted(str(admission["clusterQueue"]), flavors)
    # Why it waits: its eviction until it is admitted again, the Admitted condition once quota is reserved
    # (admission checks), else QuotaReserved's.
    if _true(workload, EVICTED):
        assert evicted is not None
        return Waiting(str(evicted.get("reason", "Evicted")), str(evicted.get("message", "")))
    for type_ in (ADMITTED, QUOTA_RESERVED) if _true(workload, QUOTA_RESERVED) else (QUOTA_RESERVED,):
        found = _condition(workload, type_)
        if found is not None:
            return Waiting(str(found.get("reason", "Pending")), str(found.get("message", "")))
    return Waiting("Pending", "Kueue has not considered the Workload yet")


@dataclass(frozen=True)
class Flavors:
    """The ResourceFlavors Kueue may admit into (by name: their spec)."""

    specs: dict[str, dict[str, Any]] = field(default_factory=dict)

    def placement(self, names: Sequence[str]) -> Placement:
        """The node labels and tolerations the pods of a pod set admitted into ``names`` must carry."""
        node_selector: dict[str, str] = {}
        tolerations: list[dict[str, Any]] = []
        for name in sorted(set(names)):
            spec = self.specs.get(name) or {}
            node_selector.update(spec.get("nodeLabels") or {})
            tolerations += [t for t in spec.get("tolerations") or [] if t not in tolerations]
        return Placement(node_selector, tolerations)

    def missing(self, admitted: Admitted) -> list[str]:
        return sorted({f for flavors in admitted.flavors.values() for f in flavors.values() if f not in self.specs})


def placements(admitted: Admitted, flavors: Flavors) -> dict[str, Placement]:
    """Role (pod set) → the placement of its pods."""
    return {role: flavors.placement(list(assigned.values())) for role, assigned in admitted.flavors.items()}


# -- what the operator writes on the Workload's status ------------------------------------------------------------


def _set_condition(
    workload: Mapping[str, Any],
    conditions: list[dict[str, Any]],
    change: tuple[str, bool, str, str],
    now: str,
) -> list[dict[str, Any]]:
    """``conditions`` with ``change`` (type, status, reason, message) set, as Kueue's API wants it."""
    type_, status, reason, message = change
    value = "True" if status else "False"
    old = next((c for c in conditions if c.get("type") == type_), None)
    new = {
        "type": type_,
        "status": value,
        "reason": reason,
        "message": message[:32768],
        "lastTransitionTime": old["lastTransitionTime"] if old and old.get("status") == value else now,
        "observedGeneration": workload["metadata"].get("generation", 0),
    }
    return [new if c is old else c for c in conditions] if old else [*conditions, new]


def _conditions_patch(
    workload: Mapping[str, Any], changes: Sequence[tuple[str, bool, str, str]], now: str
) -> list[Any]:
    """The Workload's whole list of conditions after ``changes`` (a merge patch replaces a list as a whole)."""
    conditions = [dict(c) for c in (workload.get("status") or {}).get("conditions") or []]
    for change in changes:
        conditions = _set_condition(workload, conditions, change, now)
    return conditions


STOPPED_PHASES = ("Succeeded", "Failed")


def holding_quota(pods: Sequence[Mapping[str, Any]]) -> list[str]:
    """The pods that still hold the job's quota, by name: every pod whose containers have not stopped, those being
    deleted included (Kueue's own pod integration counts a terminating pod as active until it stops; an evicted
    vLLM may hold its GPUs until it has shut down)."""
    return [
        str(pod["metadata"]["name"])
        for pod in pods
        if (pod.get("status") or {}).get("phase", "Pending") not in STOPPED_PHASES
    ]


def release(workload: Mapping[str, Any], evicting: Evicting, now: str) -> dict[str, Any]:
    """The status merge patch (on the resourceVersion it was computed from) that hands an evicted Workload's quota
    back once its pods are gone: no admission, QuotaReserved and Admitted false, and Requeued as Kueue's job
    integrations set it."""
    changes = [
        (QUOTA_RESERVED, False, "Pending", evicting.message),
        (ADMITTED, False, "NoReservation", "The workload has no reservation"),
        (REQUEUED, evicting.reason in REQUEUING_REASONS, evicting.reason, evicting.message),
    ]
    return {
        "metadata": {"resourceVersion": workload["metadata"]["resourceVersion"]},
        "status": {"admission": None, "conditions": _conditions_patch(workload, changes, now)},
    }


def finish(workload: Mapping[str, Any], succeeded: bool, message: str, now: str) -> dict[str, Any] | None:
    """The status patch that tells Kueue the job ended (it releases the quota), or None when it knows."""
    if _true(workload, FINISHED):
        return None
    change = (FINISHED, True, "Succeeded" if succeeded else "Failed", message)
    return {
        "metadata": {"resourceVersion": workload["metadata"]["resourceVersion"]},
        "status": {"conditions": _conditions_patch(workload, [change], now)},
    }
