"""A plan's writes, in their order, and what came of them (an ``Outcome``, for the caller to act on).

The order: the children a pod needs (its ConfigMap, its Role), then pod deletions and annotations side by side,
Kueue Workload statuses, pod creations (none once a child was refused), the job's status as a merge patch on
the resourceVersion the plan was computed from, and only once that write succeeded the pass's Events and the
job's deletion (``announce``).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

from kubernetes.client.exceptions import ApiException

from lockstep import keys
from lockstep.api import RLJobStatus
from lockstep.events import AckGate, JobKey
from lockstep.reconcile import Plan
from lockstep.reconcile.context import Event

logger = logging.getLogger("lockstep.applier")


class ApplierClient(Protocol):
    """The writes the Applier makes (lockstep.kubeclient.KubeClient). Each raises the kubernetes client's
    ApiException for an error, except that deletes take an object already gone for done, and pod writes try
    429 and 5xx again."""

    def apply(self, child: dict[str, Any]) -> None:
        """Server-side apply of a child (ConfigMap, Service, ServiceAccount, Role, RoleBinding, NetworkPolicy,
        Workload, LeaderWorkerSet), forced, as the operator's field manager; one that carries a uid only onto the
        object of that uid (desired.onto)."""
        ...

    def delete_child(self, kind: str, namespace: str, name: str) -> None: ...

    def delete_pod(self, namespace: str, name: str) -> None: ...

    def annotate_pod(self, namespace: str, name: str, values: dict[str, str]) -> None: ...

    def patch_workload_status(self, namespace: str, name: str, patch: dict[str, Any]) -> None: ...

    def create_pod(self, namespace: str, pod: dict[str, Any]) -> dict[str, Any]:
        """The created pod, as the API server answered."""
        ...

    def read_pod(self, namespace: str, name: str) -> dict[str, Any] | None: ...

    def patch_job_status(self, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        """A merge patch of the RLJob's status subresource; the job as written."""
        ...

    def post_event(self, job: dict[str, Any], type_: str, reason: str, message: str) -> None: ...

    def delete_job(self, namespace: str, name: str) -> None: ...


class WriteRecord(Protocol):
    """Where the Applier records its writes for the next pass to see (lockstep.world.World)."""

    def expect_writes(self, key: JobKey, annotate: dict[str, dict[str, str]], delete: list[str]) -> None: ...

    def pod_created(self, key: JobKey, pod: dict[str, Any]) -> None: ...

    def has_pod(self, key: JobKey, name: str) -> bool: ...

    def relist_pods(self, key: JobKey) -> None: ...

    def name_taken(self, key: JobKey, name: str, metadata: dict[str, Any]) -> None: ...

    def taken(self, key: JobKey) -> set[str]: ...

    def wrote_status(self, key: JobKey, written: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class Applied:
    """Every write went through, the status last: what the caller opens, then wakes the job for."""

    gate: AckGate | None
    """The open barrier phase and the members whose ack it waits for; None when the pass did not step one."""
    requeue_after: float | None
    """Seconds until the job's next pass of the whole pipeline; None: none is due (or the job is deleted)."""
    events: tuple[Event, ...]
    delete_job: bool


@dataclass(frozen=True)
class Conflict:
    """The status write found the job changed since it was read (409), or a child applied onto the object its pass
    read (desired.onto) found that object deleted or made anew: read it anew, one more pass, which writes the status
    and posts the Events."""


@dataclass(frozen=True)
class Rejected:
    """The API server refused a child or a pod, or pods not labelled as the job's hold names it needs: the status is
    not written; one more pass, at once, reports it on the job."""

    generation: int | None
    """The job's generation the refusals are for."""
    refused: dict[str, str]
    """What was refused → the API server's message."""
    taken: list[str]
    """The pods not created because a pod not labelled as the job's holds their names."""


Outcome = Applied | Conflict | Rejected


class Applier:
    """Writes a plan (``apply``, then ``announce`` for an ``Applied``), remembering which children were applied so
    that a pass that changes none of them sends none."""

    def __init__(self, client: ApplierClient, world: WriteRecord, pod_writers: Executor) -> None:
        self._client = client
        self._world = world
        self._pod_writers = pod_writers
        """Pod writes are independent of one another: they are sent side by side."""
        self._guard = threading.Lock()
        self._applied_children: dict[JobKey, str] = {}
        """What each job's children were last applied as (their hash)."""
        self._children_deleted: set[JobKey] = set()
        """Jobs one of whose children was deleted since their pass began applying them."""

    def apply(self, key: JobKey, job: dict[str, Any], plan: Plan) -> Outcome:
        """Every write of ``plan`` for ``job`` (as read, with its resourceVersion) up to its status."""
        namespace, name = key
        refused: dict[str, str] = {}
        children_hash = json.dumps([plan.children, plan.remove_children], sort_keys=True)
        # A pod about to be created needs its children (its ConfigMap, its Role): apply them first, whatever the cache.
        changes = plan.children or plan.remove_children
        if changes and (plan.create_pods or self._applied_children.get(key) != children_hash):
            with self._guard:
                self._children_deleted.discard(key)
            for child in plan.children:
                what = f"{child['kind']} {child['metadata']['name']}"
                try:
                    self._client.apply(child)
                except ApiException as error:
                    if _changed_since_read(child, error):
                        logger.info("%s of RLJob %s/%s changed since the pass read it: one more pass", what, *key)
                        return Conflict()
                    refused.update(_refusal(what, error))
            for kind, child_name in plan.remove_children:
                self._client.delete_child(kind, namespace, child_name)
            with self._guard:
                if not refused and key not in self._children_deleted:
                    self._applied_children[key] = children_hash
        for pod_name, why in plan.delete_pods.items():
            logger.info("deleting pod %s/%s: %s", namespace, pod_name, why)
        self._world.expect_writes(key, plan.annotate_pods, list(plan.delete_pods))
        calls: list[Callable[[], None]] = [
            *(partial(self._client.delete_pod, namespace, pod_name) for pod_name in plan.delete_pods),
            *(
                partial(self._client.annotate_pod, namespace, pod_name, values)
                for pod_name, values in plan.annotate_pods.items()
            ),
        ]
        list(self._pod_writers.map(lambda call: call(), calls))
        for workload, patch in plan.workload_status.items():
            try:
                self._client.patch_workload_status(namespace, workload, patch)
            except ApiException as error:
                if error.status != 409:  # Kueue wrote the Workload meanwhile: its watch event asks for another pass
                    raise
        creations = [] if refused else plan.create_pods
        for refusal in self._pod_writers.map(lambda pod: self._create_pod(key, pod), creations):
            refused.update(refusal)
        held = self._world.taken(key)
        taken = [pod["metadata"]["name"] for pod in creations if pod["metadata"]["name"] in held]
        if taken:
            logger.warning("pods not labelled as RLJob %s/%s's hold names it needs: %s", namespace, name, taken)
        if refused:
            logger.warning("the API server refused what RLJob %s/%s asks for: %s", namespace, name, refused)
        if refused or taken:
            return Rejected(job["metadata"].get("generation"), refused, taken)
        if not self._write_status(key, job, plan.status):
            return Conflict()
        barrier = plan.status.barrier
        gate = (
            None
            if barrier is None or plan.waiting_for is None
            else AckGate(barrier.id, barrier.phase, dict(barrier.retries), set(plan.waiting_for))
        )
        return Applied(gate, None if plan.delete_job else plan.requeue_after, tuple(plan.events), plan.delete_job)

    def announce(self, key: JobKey, job: dict[str, Any], applied: Applied) -> None:
        """Post the pass's Events (the status they describe is written), then delete the job if its time is up.
        An Event that cannot be posted (its namespace is being deleted) is only logged."""
        for event in applied.events:
            try:
                self._client.post_event(job, event.type, event.reason, event.message)
            except ApiException as error:
                logger.warning(
                    "could not post Event %s on RLJob %s: %s", event.reason, job["metadata"]["name"], error.reason
                )
        if applied.delete_job:
            namespace, name = key
            logger.info("deleting RLJob %s/%s: ttlSecondsAfterFinished passed", namespace, name)
            self._client.delete_job(namespace, name)

    def child_deleted(self, key: JobKey) -> None:
        """One of the job's children was deleted: its next pass applies them all again."""
        with self._guard:
            self._applied_children.pop(key, None)
            self._children_deleted.add(key)  # a pass applying them now may have missed it

    def reapply_all(self) -> None:
        """Every job's next pass applies its children anew (the periodic resync)."""
        with self._guard:
            self._applied_children.clear()

    def forget(self, key: JobKey) -> None:
        """The job is gone."""
        with self._guard:
            self._applied_children.pop(key, None)
            self._children_deleted.discard(key)

    def _write_status(self, key: JobKey, job: dict[str, Any], status: RLJobStatus) -> bool:
        """Write what changed in the status as a merge patch, on the resourceVersion it was computed from;
        False when the job changed meanwhile (409)."""
        new = status.model_dump(mode="json", by_alias=True, exclude_none=True)
        changes = merge_patch(job.get("status") or {}, new)
        if not changes:
            return True
        body = {"metadata": {"resourceVersion": job["metadata"]["resourceVersion"]}, "status": changes}
        try:
            written = self._client.patch_job_status(*key, body)
        except ApiException as error:
            if error.status != 409:
                raise
            return False
        written["metadata"].pop("managedFields", None)
        self._world.wrote_status(key, written)
        return True

    def _create_pod(self, key: JobKey, pod: dict[str, Any]) -> dict[str, str]:
        """Create ``pod`` and keep the API server's answer; ``_refused``'s verdict. A pod that exists already
        is the job's own, still terminating (the World has it: its deletion asks for the next pass) or not yet
        brought by the watch (then the next pass lists the job's pods again); or it is not labelled as the
        job's (someone else's, or relabelled): the World keeps it for the next pass to report."""
        namespace, job = key
        name = pod["metadata"]["name"]
        try:
            created = self._client.create_pod(namespace, pod)
        except ApiException as error:
            if error.status == 409:
                cached = self._world.has_pod(key, name)
                found = None if cached else self._client.read_pod(namespace, name)
                if found is not None and not _labelled_as_of(found, job):
                    self._world.name_taken(key, name, found["metadata"])
                elif not cached:
                    self._world.relist_pods(key)
            return _refusal(f"Pod {name}", error)
        self._world.pod_created(key, created)
        return {}


def _changed_since_read(child: dict[str, Any], error: ApiException) -> bool:
    """Whether the API server refused ``child``, applied onto the object of the uid it carries, because that object
    is gone (409) or another has its name now (422 on metadata.uid)."""
    if "uid" not in child["metadata"]:
        return False
    return error.status == 409 or (error.status == 422 and "metadata.uid" in (error.body or ""))


def _refusal(what: str, error: ApiException) -> dict[str, str]:
    """The verdict on the API server's ``error`` for ``what``: when it refuses the object (400 or 422: invalid; 403:
    an admission policy, a quota), ``{what: its message}``; {} for 409 (it exists already); any other error raises."""
    if error.status == 409:
        return {}
    if error.status not in (400, 403, 422):
        raise error
    try:
        return {what: str(json.loads(error.body or "")["message"])}
    except (ValueError, KeyError, TypeError):
        return {what: f"{error.status} {error.reason}"}


def _labelled_as_of(pod: dict[str, Any], job: str) -> bool:
    """Whether ``pod`` carries the labels of ``job``'s pods, the ones the pod watch selects and files it under."""
    labels = pod["metadata"].get("labels") or {}
    return bool(labels.get(keys.MANAGED_BY) == keys.MANAGER and labels.get(keys.JOB) == job)


def merge_patch(old: Any, new: Any) -> Any:
    """The JSON merge patch (RFC 7386) that turns ``old`` into ``new`` (which holds no nulls): only what changed;
    None for no change."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return None if old == new else new
    patch = {key: None for key in old if key not in new}
    for key, value in new.items():
        if key not in old:
            patch[key] = value
        elif (inner := merge_patch(old[key], value)) is not None:
            patch[key] = inner
    return patch or None
