"""What the operator knows of the cluster between passes, and a pass's ``Observed`` built from it.

Each job as last seen (its watch, or the answer to the operator's own status write), its pods as the pod watch
delivered them (lockstep.events.PodCache), the ParityPolicies, the namespaces, the open barrier phase's gate,
and what the API server refused the job or a pod not labelled as its own holds. ``observe`` reads the API
server only for what is not kept here.

Kept here rather than in kopf's indexes: an index is handed only to kopf's own handlers, on kopf's event loop,
while passes run on threads of their own; and these caches also take the operator's writes (a status write's
answer, pod annotations about to be written, a create's answer), ordered against the watches' versions by
resourceVersion, which an index of watched objects cannot.
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import threading
from collections.abc import Callable, Mapping
from enum import Enum
from typing import Any, Protocol

from lockstep import desired, keys, kueue
from lockstep.events import AckGate, AckVerdict, JobKey, PassScope, PodCache, pass_for, revision
from lockstep.reconcile import KueueView, Observed, ownership
from lockstep.reconcile.context import annotation


class WorldClient(Protocol):
    """The reads the World makes of the API server (lockstep.kubeclient.KubeClient): None for an object that is
    not there; any other error raises."""

    def list_jobs(self) -> list[dict[str, Any]]: ...

    def get_job(self, namespace: str, name: str) -> dict[str, Any] | None: ...

    def list_job_pods(self, namespace: str, job: str) -> dict[str, Any]:
        """The job's pods as a PodList: ``items`` and ``metadata.resourceVersion``."""
        ...

    def list_policies(self) -> list[dict[str, Any]]: ...

    def read_namespace(self, name: str) -> dict[str, Any]: ...

    def list_workloads(self, namespace: str, job: str) -> list[dict[str, Any]]: ...

    def list_resource_flavors(self) -> list[dict[str, Any]]: ...

    def get_priority_class(self, name: str) -> dict[str, Any] | None: ...

    def read_stateful_set(self, namespace: str, name: str) -> dict[str, Any] | None: ...

    def read_group_set(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The LeaderWorkerSet ``name``, with its managedFields."""
        ...


class Unobserved(Enum):
    """Why a pass has nothing to reconcile."""

    JOB_GONE = "the job is gone"
    NAMESPACE_TERMINATING = "its namespace is being deleted, and takes the job and its children"


class World:
    """The caches a pass reads, each guarded by one lock that no call to the API server is made under."""

    def __init__(
        self,
        client: WorldClient,
        backoff_base_seconds: float = 10.0,
        kueue: bool = False,
        trainer_env: Mapping[str, str] | None = None,
    ) -> None:
        self._client = client
        self.trainer_env = dict(trainer_env or {})
        """Environment defaults of the trainer pods from the operator's own (lockstep.tracing.forwarded)."""
        self.backoff_base_seconds = backoff_base_seconds
        self.kueue = kueue
        """Whether Kueue manages the jobs labelled kueue.x-k8s.io/queue-name (--kueue): a pass reads their Workloads."""
        self._guard = threading.Lock()
        self._jobs: dict[JobKey, dict[str, Any]] = {}
        self._own_writes: dict[JobKey, str] = {}
        """The resourceVersion of each job's last status write by this operator."""
        self._pods: dict[JobKey, PodCache] = {}
        """Each job's pods as the pod watch delivered them: a pass does not list them."""
        self._ack_order: dict[JobKey, dict[str, int]] = {}
        """When each member's ack last changed (a counter): the pass sees the members in that order."""
        self._ack_clock = itertools.count(1)
        self._gates: dict[JobKey, AckGate] = {}
        self._policies: dict[str, dict[str, Any]] | None = None
        self._namespaces: dict[str, dict[str, Any]] = {}
        self._rejected: dict[JobKey, tuple[int | None, dict[str, str]]] = {}
        """What the API server refused to create for a job, at the generation it was refused for."""
        self._taken: dict[JobKey, dict[str, dict[str, Any]]] = {}
        self._owner_cache: dict[str, dict[str, Any]] = {}
        """The owners of pods labelled as a job's (StatefulSets, LeaderWorkerSets), by UID (``_owners``)."""
        """Pods a job would create whose name a pod not labelled as the job's has: name → that pod's metadata."""

    # -- a pass's view ---------------------------------------------------------------------

    def observe(self, key: JobKey, scope: PassScope) -> Observed | Unobserved:
        """What a pass of ``scope`` reconciles for the job: the whole pipeline unless the last pass left a gate."""
        namespace, _ = key
        with self._guard:
            if key not in self._gates:
                scope = PassScope.FULL  # the last pass did not step a barrier (or its status write failed)
        job = self._job(key)
        if job is None:
            return Unobserved.JOB_GONE
        pods = self._job_pods(key)
        policies = self._policy_list()
        namespace_object = self._namespace(namespace)
        if (namespace_object.get("status") or {}).get("phase") == "Terminating":
            return Unobserved.NAMESPACE_TERMINATING  # nothing to create there
        labels = namespace_object["metadata"].get("labels", {})
        with self._guard:
            generation, rejected = self._rejected.get(key, (None, {}))
            order = dict(self._ack_order.get(key, {}))
        if generation != job["metadata"].get("generation"):
            rejected = {}  # the spec changed since: try again
        now = dt.datetime.now(dt.UTC)
        pods.sort(key=lambda pod: order.get(pod["metadata"]["name"], 0))  # acks in the order they came
        queue = self._kueue_view(job) if self.kueue else None  # a barrier pass may hand over to the whole pipeline
        with self._guard:
            taken = dict(self._taken.get(key, {}))
        group_set = None
        if (job.get("spec") or {}).get("actors", {}).get("group") is not None:
            group_set = self._client.read_group_set(namespace, desired.actor_set_name(job["metadata"]["name"]))
        return Observed(
            job,
            pods,
            policies,
            labels,
            now,
            self.backoff_base_seconds,
            rejected,
            queue,
            scope,
            taken,
            owners=self._owners(namespace, pods),
            group_set=group_set,
            trainer_env=self.trainer_env,
        )

    def _owners(self, namespace: str, pods: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """The StatefulSets that control ``pods``, and the LeaderWorkerSets that control those, by UID: read once
        per UID (an object's UID is never reused; its controller reference, once set, is not moved by
        LeaderWorkerSet or the StatefulSet controller, and admission keeps others from writing Lockstep's)."""
        found: dict[str, dict[str, Any]] = {}
        wanted = [ownership.controller_of(pod["metadata"]) for pod in pods]
        for ref in [ref for ref in wanted if ref is not None and ref.get("kind") == ownership.STATEFUL_SET]:
            stateful_set = self._owner(namespace, ref, self._client.read_stateful_set)
            if stateful_set is None:
                continue
            found[str(ref["uid"])] = stateful_set
            above = ownership.controller_of(stateful_set["metadata"])
            if above is not None and above.get("kind") == desired.LEADER_WORKER_SET:
                group_set = self._owner(namespace, above, self._client.read_group_set)
                if group_set is not None:
                    found[str(above["uid"])] = group_set
        return found

    def _owner(
        self, namespace: str, ref: dict[str, Any], read: Callable[[str, str], dict[str, Any] | None]
    ) -> dict[str, Any] | None:
        """The owner ``ref`` names (kind and metadata, without managedFields), cached by UID; None when there is
        none of that name and UID."""
        uid = str(ref.get("uid"))
        with self._guard:
            if uid in self._owner_cache:
                return self._owner_cache[uid]
        read_back = read(namespace, str(ref.get("name")))
        if read_back is None or read_back["metadata"].get("uid") != uid:
            return None  # not cached: it may come later under this UID
        read_back["metadata"].pop("managedFields", None)
        kept = {"kind": read_back.get("kind", ref.get("kind")), "metadata": read_back["metadata"]}
        with self._guard:
            self._owner_cache[uid] = kept
        return kept

    def _job(self, key: JobKey) -> dict[str, Any] | None:
        """The job as last seen (watched, or as the operator wrote it), or read; None when it is gone."""
        with self._guard:
            cached = self._jobs.get(key)
        if cached is not None:
            copy: dict[str, Any] = json.loads(json.dumps(cached))  # the pass changes its copy
            return copy
        return self._client.get_job(*key)

    def _job_pods(self, key: JobKey) -> list[dict[str, Any]]:
        """The job's pods: from the pod watch, once they were listed (by the watch's own list, which also follows a
        lost watch, or for this job alone: a job the watch's list did not know, a create that found a pod)."""
        with self._guard:
            cache = self._pods.setdefault(key, PodCache())
            if cache.listed:
                return list(cache.pods.values())
        listed = self._client.list_job_pods(*key)
        with self._guard:
            cache = self._pods.setdefault(key, PodCache())
            cache.merge_list(listed["items"], listed["metadata"].get("resourceVersion", ""))
            return list(cache.pods.values())

    def _policy_list(self) -> list[dict[str, Any]]:
        """Every ParityPolicy: listed once (and again after each periodic resync), then kept by the watch."""
        with self._guard:
            if self._policies is not None:
                return list(self._policies.values())
        listed = self._client.list_policies()
        with self._guard:
            self._policies = {policy["metadata"]["name"]: policy for policy in listed}
        return list(listed)

    def _namespace(self, name: str) -> dict[str, Any]:
        """The namespace (its labels select ParityPolicies), read once per periodic resync."""
        with self._guard:
            cached = self._namespaces.get(name)
        if cached is None:
            cached = self._client.read_namespace(name)
            with self._guard:
                self._namespaces[name] = cached
        return cached

    def _kueue_view(self, job: dict[str, Any]) -> KueueView:
        """The job's Workloads, read on every pass (a pass that missed one could delete an admitted job's pods),
        the ResourceFlavors they were admitted to, and the job's WorkloadPriorityClass."""
        workloads = self._client.list_workloads(job["metadata"]["namespace"], job["metadata"]["name"])
        flavors = {}
        if any((w.get("status") or {}).get("admission") for w in workloads):
            flavors = {f["metadata"]["name"]: f.get("spec") or {} for f in self._client.list_resource_flavors()}
        classes = {}
        wanted = kueue.priority_class_name(job)
        if wanted is not None and (found := self._client.get_priority_class(wanted)) is not None:
            classes[wanted] = found
        return KueueView(workloads, kueue.Flavors(flavors), classes)

    # -- what the watches deliver ----------------------------------------------------------

    def job_event(self, key: JobKey, job: dict[str, Any] | None) -> None:
        """Keep the job as its watch delivered it (None: deleted)."""
        if job is None:
            with self._guard:
                self._jobs.pop(key, None)
        else:
            self._keep_job(key, job)

    def _keep_job(self, key: JobKey, job: dict[str, Any]) -> None:
        """Keep ``job`` unless a newer version is kept already: the echo of an earlier write can arrive after
        the answer to a later one. (resourceVersions are etcd revisions, compared as numbers; one that is not
        a number replaces what is kept, and a conflict on the next write reads the job anew.)"""
        with self._guard:
            kept = self._jobs.get(key)
            if kept is None or not _older(job, kept):
                self._jobs[key] = job

    def caused_by_own_write(self, key: JobKey, resource_version: str | None) -> bool:
        """Whether an RLJob event only reports this operator's own status write (nothing new to act on)."""
        return resource_version is not None and self._own_writes.get(key) == resource_version

    def policy_event(self, name: str, policy: dict[str, Any] | None) -> None:
        """Keep the ParityPolicy as its watch delivered it (None: deleted), once the policies were listed."""
        with self._guard:
            if self._policies is not None:
                if policy is None:
                    self._policies.pop(name, None)
                else:
                    self._policies[name] = policy

    def pods_listed(self, pods: list[dict[str, Any]], revision: str) -> set[JobKey]:
        """The pod watch listed every Lockstep pod at ``revision``: each job's pods are these. The jobs known."""
        by_job: dict[JobKey, list[dict[str, Any]]] = {}
        for pod in pods:
            job = (pod["metadata"].get("labels") or {}).get(keys.JOB)
            if job:
                by_job.setdefault((pod["metadata"]["namespace"], job), []).append(pod)
        with self._guard:
            for key in {*by_job, *self._pods}:
                self._pods.setdefault(key, PodCache()).merge_list(by_job.get(key, []), revision)
            return set(self._pods)

    def pod_event(self, key: JobKey, event: str, pod: dict[str, Any]) -> PassScope | None:
        """A pod of the job was added, changed or deleted (``event``): the pass it needs, if any (judged by the
        gate, in the same hold of the lock as the cache takes the pod)."""
        name = pod["metadata"]["name"]
        with self._guard:
            cache = self._pods.setdefault(key, PodCache())
            before = cache.facts(name)
            cache.observe(event, pod)
            after = cache.facts(name)
            acked = after is not None and after.annotation(keys.BARRIER_ACK)
            if acked and (before is None or before.annotation(keys.BARRIER_ACK) != acked):
                self._ack_order.setdefault(key, {})[name] = next(self._ack_clock)
            return pass_for(before, after, self._gates.get(key), name)

    # -- what the operator writes (lockstep.applier) -----------------------------------------

    def expect_writes(self, key: JobKey, annotate: dict[str, dict[str, str]], delete: list[str]) -> None:
        """Record the pod annotations and deletions about to be written: the next pass sees them before their
        echo comes back from the watch, and the echo asks for no pass."""
        now = dt.datetime.now(dt.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
        with self._guard:
            cache = self._pods.setdefault(key, PodCache())
            for pod, values in annotate.items():
                cache.annotate(pod, values)
            for pod in delete:
                cache.deleting(pod, now)

    def pod_created(self, key: JobKey, pod: dict[str, Any]) -> None:
        """Keep the API server's answer to the pod's create."""
        with self._guard:
            self._pods.setdefault(key, PodCache()).observe("ADDED", pod)

    def has_pod(self, key: JobKey, name: str) -> bool:
        with self._guard:
            return name in self._pods.setdefault(key, PodCache()).pods

    def relist_pods(self, key: JobKey) -> None:
        """The job's pods are not all here: the next pass lists them."""
        with self._guard:
            self._pods.setdefault(key, PodCache()).listed = False

    def name_taken(self, key: JobKey, name: str, metadata: dict[str, Any]) -> None:
        """A pod not labelled as the job's holds the name of one it needs: kept for the next pass to report."""
        with self._guard:
            self._taken.setdefault(key, {})[name] = metadata

    def taken(self, key: JobKey) -> set[str]:
        """The names of the job's pods that pods not labelled as its own hold."""
        with self._guard:
            return set(self._taken.get(key, {}))

    def wrote_status(self, key: JobKey, written: dict[str, Any]) -> None:
        """The operator wrote the job's status: keep the answer, and take its echo for nothing new."""
        self._own_writes[key] = written["metadata"]["resourceVersion"]
        self._keep_job(key, written)

    # -- what a pass's outcome leaves (lockstep.controller) ---------------------------------

    def open_gate(self, key: JobKey, gate: AckGate | None) -> bool:
        """Wait for the acks the open barrier phase still needs (None: none is awaited, and acks alone ask for no
        pass); the acks that came in while the pass ran are judged at once. Whether one needs a pass."""
        with self._guard:
            if gate is None:
                self._gates.pop(key, None)
                return False
            pods = self._pods.get(key, PodCache()).pods
            verdicts = {gate.on_ack(pod, annotation(pods[pod], keys.BARRIER_ACK)) for pod in gate.waiting & set(pods)}
            self._gates[key] = gate
            return AckVerdict.NEEDS_PASS in verdicts

    def drop_gate(self, key: JobKey) -> None:
        """What the last pass wrote is unknown: the next pass is a whole one."""
        with self._guard:
            self._gates.pop(key, None)

    def reread(self, key: JobKey) -> None:
        """The job changed since it was read: the next pass reads it anew, and is a whole one."""
        with self._guard:
            self._gates.pop(key, None)
            self._jobs.pop(key, None)

    def refused(self, key: JobKey, generation: int | None, refused: dict[str, str]) -> None:
        """The API server refused ``refused`` for the job at ``generation``; its namespace is read again (it may be
        terminating)."""
        with self._guard:
            self._rejected[key] = (generation, refused)
            self._namespaces.pop(key[0], None)

    def resync(self) -> list[dict[str, Any]]:
        """Every RLJob, listed (without managedFields), for the caller to keep (``job_event``) and reconcile in case
        a watch event was missed; what was refused (a quota, a policy) may be accepted now, a pod that held a job's
        pod name may be gone, and the policies and namespaces are read anew."""
        jobs = self._client.list_jobs()
        with self._guard:
            self._rejected.clear()
            self._taken.clear()
            self._owner_cache.clear()
            self._policies, self._namespaces = None, {}
        for job in jobs:
            job["metadata"].pop("managedFields", None)
        return jobs

    def forget(self, key: JobKey) -> None:
        """The job is gone: drop what is kept about it."""
        with self._guard:
            for kept in (self._rejected, self._taken, self._own_writes, self._gates, self._ack_order, self._jobs):
                kept.pop(key, None)
            self._pods.pop(key, None)


def _older(job: dict[str, Any], than: dict[str, Any]) -> bool:
    """Whether ``job`` is an older version of the same object than ``than``."""
    version, kept = revision(job), revision(than)
    return version is not None and kept is not None and version < kept
