"""The operator's imperative shell: kopf handlers (and a pod watch of its own) that read, call the pure
reconciler, apply.

Run it with ``python -m lockstep.controller`` (uses $KUBECONFIG, or the in-cluster service account).
With ``--leader-election`` several replicas can run: only the holder of a Lease reconciles (lockstep.leader).

Every trigger (an RLJob event, an event of one of the operator's own pods, a ParityPolicy
change, a requeue) asks for a reconcile of one job. Requests for a job that is being
reconciled are coalesced into one more pass, so a burst of pod events costs one pass, not
hundreds. A pod event asks for a pass only when it changes what a pass reads, and an ack that
answers an open barrier phase only when it is the last one that phase waits for, for a pass of the
barrier step alone (lockstep.events). The status is written as a merge patch of what changed, with the
resourceVersion it was computed from (a conflict means another pass), and the pass's Events
only after that write succeeded.
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import kopf
import prometheus_client
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from lockstep import api, keys, kueue, leader, metrics, responses
from lockstep.api import RLJobStatus
from lockstep.events import AckGate, AckVerdict, PassScope, PodCache, pass_for, revision
from lockstep.podwatch import PodWatch
from lockstep.reconcile import KueueView, Observed, Plan, reconcile
from lockstep.reconcile.context import annotation

RLJOBS = (api.GROUP, api.VERSION, api.RLJOBS)
POLICIES = (api.GROUP, api.VERSION, api.PARITY_POLICIES)
WORKLOADS = (kueue.GROUP, kueue.VERSION, kueue.WORKLOADS)
FIELD_MANAGER = "lockstep-operator"
SAFETY_NET_SECONDS = 60.0
POD_WRITERS = 16
PASS_WORKERS = 4
"""Passes that pod events ask for run on this many threads (one job's pass at a time, coalesced)."""
WRITE_ATTEMPTS = 4
"""Tries of one pod write that the API server answered 429 or 5xx, with a backoff of 0.1 s, 0.2 s, 0.4 s."""

logger = logging.getLogger("lockstep.controller")
JobKey = tuple[str, str]  # (namespace, name)


class Shell:
    """Reads a job's world from the API server, reconciles it, and applies the plan."""

    def __init__(self, api_client: client.ApiClient, backoff_base_seconds: float = 10.0, kueue: bool = False) -> None:
        self.kueue = kueue
        """Whether Kueue manages the jobs labelled kueue.x-k8s.io/queue-name (--kueue)."""
        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self.rbac = client.RbacAuthorizationV1Api(api_client)
        self.networking = client.NetworkingV1Api(api_client)
        self.backoff_base_seconds = backoff_base_seconds
        self._guard = threading.Lock()
        self._running: set[JobKey] = set()
        self._dirty: dict[JobKey, PassScope] = {}
        """Jobs asked for again while their pass ran: the scope of the pass that follows."""
        self._applied_children: dict[JobKey, str] = {}
        self._children_deleted: set[JobKey] = set()
        """Jobs one of whose children was deleted since their pass began applying them."""
        self._rejected: dict[JobKey, tuple[int | None, dict[str, str]]] = {}
        """What the API server refused to create for a job, at the generation it was refused for."""
        self._taken: dict[JobKey, dict[str, dict[str, Any]]] = {}
        """Pods a job would create whose name a pod not labelled as the job's has: name → that pod's metadata."""
        self._own_writes: dict[JobKey, str] = {}  # the resourceVersion of each job's last status write
        self._pods_pool = ThreadPoolExecutor(max_workers=POD_WRITERS, thread_name_prefix="pod-writer")
        self._passes = ThreadPoolExecutor(max_workers=PASS_WORKERS, thread_name_prefix="pass")
        self._pods: dict[JobKey, PodCache] = {}
        """Each job's pods as the pod watch delivered them: a pass does not list them."""
        self._gates: dict[JobKey, AckGate] = {}
        self._ack_order: dict[JobKey, dict[str, int]] = {}
        """When each member's ack last changed (a counter): the pass sees the members in that order."""
        self._ack_clock = itertools.count(1)
        self._timers: dict[JobKey, tuple[float, threading.Timer]] = {}
        """Each job's wake-up: when it is due (time.monotonic()), and its timer."""
        self._jobs: dict[JobKey, dict[str, Any]] = {}
        self._policies: dict[str, dict[str, Any]] | None = None
        self._namespaces: dict[str, dict[str, Any]] = {}

    # -- coalescing ----------------------------------------------------------------------

    def request(self, namespace: str, name: str, scope: PassScope = PassScope.FULL) -> None:
        """Reconcile the job now, or once more right after the pass already running for it (one pass for all the
        requests that came meanwhile, of the widest scope they asked for)."""
        key = (namespace, name)
        with self._guard:
            if key in self._running:
                self._ask_again(key, scope)
                return
            self._running.add(key)
        try:
            while True:
                with metrics.RECONCILE_SECONDS.time():
                    self._reconcile_once(key, scope)
                with self._guard:
                    if key not in self._dirty:
                        # In the same hold of the guard as the check: a request that comes after it finds the job
                        # not running and runs its own pass (released later, it would only mark the job dirty).
                        self._running.discard(key)
                        return
                    scope = self._dirty.pop(key)
        except Exception:
            metrics.RECONCILE_ERRORS.inc()
            with self._guard:
                self._gates.pop(key, None)  # what the failed pass wrote is unknown: the next pass is a whole one
                self._running.discard(key)
            raise

    def _ask_again(self, key: JobKey, scope: PassScope = PassScope.FULL) -> None:
        """One more pass for the job after the one running (called with the guard held)."""
        self._dirty[key] = scope.join(self._dirty.get(key))

    def caused_by_own_write(self, namespace: str, name: str, resource_version: str | None) -> bool:
        """Whether an RLJob event only reports this operator's own status write (nothing new to act on)."""
        return resource_version is not None and self._own_writes.get((namespace, name)) == resource_version

    def request_all(self) -> None:
        """Reconcile every RLJob in the cluster (after a ParityPolicy changed, and periodically), each job's
        children applied anew; one job that fails does not keep the others from their pass."""
        jobs = responses.body(self.custom.list_cluster_custom_object(*RLJOBS, _preload_content=False))["items"]
        with self._guard:
            self._applied_children.clear()
            self._rejected.clear()  # what was refused (a quota, a policy) may be accepted now
            self._taken.clear()  # and a pod that held a job's pod name may be gone
            self._policies, self._namespaces = None, {}  # read anew, in case a watch event was missed
        for job in jobs:
            namespace, name = job["metadata"]["namespace"], job["metadata"]["name"]
            job["metadata"].pop("managedFields", None)
            self._keep_job((namespace, name), job)  # newer than what is kept, if a watch event was missed
            self._request_logged(namespace, name)

    def request_soon(self, namespace: str, name: str, scope: PassScope = PassScope.FULL) -> None:
        """Reconcile the job on a pass thread (the caller goes on); a pass that fails is logged."""
        self._passes.submit(self._request_logged, namespace, name, scope)

    def _request_logged(self, namespace: str, name: str, scope: PassScope = PassScope.FULL) -> None:
        try:
            self.request(namespace, name, scope)
        except Exception:
            logger.exception("reconciling RLJob %s/%s failed; its next event or resync tries again", namespace, name)

    def pods_listed(self, pods: list[dict[str, Any]], revision: str) -> None:
        """The pod watch listed every Lockstep pod at ``revision``: each job's pods are these, and each job known
        here gets a pass."""
        by_job: dict[JobKey, list[dict[str, Any]]] = {}
        for pod in pods:
            job = (pod["metadata"].get("labels") or {}).get(keys.JOB)
            if job:
                by_job.setdefault((pod["metadata"]["namespace"], job), []).append(pod)
        with self._guard:
            for key in {*by_job, *self._pods}:
                self._pods.setdefault(key, PodCache()).merge_list(by_job.get(key, []), revision)
            keys_known = set(self._pods)
        for namespace, name in keys_known:
            self.request_soon(namespace, name)

    def pod_changed(self, event: str, pod: dict[str, Any]) -> None:
        """The pod watch saw ``pod`` added, changed or deleted (``event``)."""
        metadata = pod["metadata"]
        job = (metadata.get("labels") or {}).get(keys.JOB)
        if job and metadata.get("namespace"):
            self.pod_event(metadata["namespace"], job, event, pod)

    def pod_event(self, namespace: str, job: str, event: str, pod: dict[str, Any]) -> None:
        """A pod of ``job`` was added, changed or deleted (``event``): a pass only when it needs one."""
        key, name = (namespace, job), pod["metadata"]["name"]
        with self._guard:
            cache = self._pods.setdefault(key, PodCache())
            before = cache.facts(name)
            cache.observe(event, pod)
            after = cache.facts(name)
            acked = after is not None and after.annotation(keys.BARRIER_ACK)
            if acked and (before is None or before.annotation(keys.BARRIER_ACK) != acked):
                self._ack_order.setdefault(key, {})[name] = next(self._ack_clock)
            scope = pass_for(before, after, self._gates.get(key), name)
        if scope is not None:
            self.request_soon(namespace, job, scope)

    def child_deleted(self, namespace: str, job: str) -> None:
        """One of the job's children was deleted: apply them all again now."""
        with self._guard:
            self._applied_children.pop((namespace, job), None)
            self._children_deleted.add((namespace, job))  # a pass applying them now may have missed it
        self.request(namespace, job)

    # -- one pass ------------------------------------------------------------------------

    def _reconcile_once(self, key: JobKey, scope: PassScope) -> None:
        namespace, name = key
        with self._guard:
            if key not in self._gates:
                scope = PassScope.FULL  # the last pass did not step a barrier (or its status write failed)
        job = self._job(key)
        if job is None:
            self._forget(key)
            metrics.forget(namespace, name)
            return
        pods = self._job_pods(key)
        policies = self._policy_list()
        namespace_object = self._namespace(namespace)
        if (namespace_object.get("status") or {}).get("phase") == "Terminating":
            return  # the namespace's deletion takes the job and its children: nothing to create there
        labels = namespace_object["metadata"].get("labels", {})
        generation, rejected = self._rejected.get(key, (None, {}))
        if generation != job["metadata"].get("generation"):
            rejected = {}  # the spec changed since: try again
        now = dt.datetime.now(dt.UTC)
        order = self._ack_order.get(key, {})
        pods.sort(key=lambda pod: order.get(pod["metadata"]["name"], 0))  # acks in the order they came
        queue = self._kueue_view(job) if self.kueue else None  # a barrier pass may hand over to the whole pipeline
        with self._guard:
            taken = dict(self._taken.get(key, {}))
        observed = Observed(job, pods, policies, labels, now, self.backoff_base_seconds, rejected, queue, scope, taken)
        plan = reconcile(observed)
        before = RLJobStatus.model_validate(job.get("status") or {})
        self._apply(key, job, plan)
        metrics.record(namespace, name, before, plan.status)

    def _job_pods(self, key: JobKey) -> list[dict[str, Any]]:
        """The job's pods: from the pod watch, once they were listed (by the watch's own list, which also follows a
        lost watch, or for this job alone: a job the watch's list did not know, a create that found a pod)."""
        with self._guard:
            cache = self._pods.setdefault(key, PodCache())
            if cache.listed:
                return list(cache.pods.values())
        namespace, name = key
        listed = responses.body(
            self.core.list_namespaced_pod(
                namespace, label_selector=f"{keys.POD_SELECTOR},{keys.JOB}={name}", _preload_content=False
            )
        )
        with self._guard:
            cache = self._pods.setdefault(key, PodCache())
            cache.merge_list(listed["items"], listed["metadata"].get("resourceVersion", ""))
            return list(cache.pods.values())

    def _kueue_view(self, job: dict[str, Any]) -> KueueView:
        """The job's Workloads, read on every pass (a pass that missed one could delete an admitted job's pods),
        the ResourceFlavors they were admitted to, and the job's WorkloadPriorityClass."""
        namespace, name = job["metadata"]["namespace"], job["metadata"]["name"]
        workloads = responses.body(
            self.custom.list_namespaced_custom_object(
                kueue.GROUP,
                kueue.VERSION,
                namespace,
                kueue.WORKLOADS,
                label_selector=f"{keys.POD_SELECTOR},{keys.JOB}={name}",
                _preload_content=False,
            )
        )["items"]
        flavors = {}
        if any((w.get("status") or {}).get("admission") for w in workloads):
            listed = self.custom.list_cluster_custom_object(
                kueue.GROUP, kueue.VERSION, kueue.RESOURCE_FLAVORS, _preload_content=False
            )
            flavors = {f["metadata"]["name"]: f.get("spec") or {} for f in responses.body(listed)["items"]}
        classes = {}
        wanted = kueue.priority_class_name(job)
        if wanted is not None:
            try:
                found = responses.body(
                    self.custom.get_cluster_custom_object(
                        kueue.GROUP, kueue.VERSION, kueue.PRIORITY_CLASSES, wanted, _preload_content=False
                    )
                )
                classes[wanted] = found
            except ApiException as error:
                if error.status != 404:
                    raise
        return KueueView(workloads, kueue.Flavors(flavors), classes)

    # -- what the watches already delivered (a pass reads the API server only for what is not here) ---------

    def job_event(self, namespace: str, name: str, job: dict[str, Any] | None) -> None:
        """Keep the job as its watch delivered it (None: deleted)."""
        if job is None:
            with self._guard:
                self._jobs.pop((namespace, name), None)
        else:
            self._keep_job((namespace, name), job)

    def _keep_job(self, key: JobKey, job: dict[str, Any]) -> None:
        """Keep ``job`` unless a newer version is kept already: the echo of an earlier write can arrive after
        the answer to a later one. (resourceVersions are etcd revisions, compared as numbers; one that is not
        a number replaces what is kept, and a conflict on the next write reads the job anew.)"""
        with self._guard:
            kept = self._jobs.get(key)
            if kept is None or not _older(job, kept):
                self._jobs[key] = job

    def policy_event(self, name: str, policy: dict[str, Any] | None) -> None:
        """Keep the ParityPolicy as its watch delivered it (None: deleted), once the policies were listed."""
        with self._guard:
            if self._policies is not None:
                if policy is None:
                    self._policies.pop(name, None)
                else:
                    self._policies[name] = policy

    def _job(self, key: JobKey) -> dict[str, Any] | None:
        """The job as last seen (watched, or as the operator wrote it), or read; None when it is gone."""
        with self._guard:
            cached = self._jobs.get(key)
        if cached is not None:
            copy: dict[str, Any] = json.loads(json.dumps(cached))  # the pass changes its copy
            return copy
        namespace, name = key
        try:
            job: dict[str, Any] = responses.body(
                self.custom.get_namespaced_custom_object(
                    api.GROUP, api.VERSION, namespace, api.RLJOBS, name, _preload_content=False
                )
            )
        except ApiException as error:
            if error.status == 404:
                return None
            raise
        return job

    def _policy_list(self) -> list[dict[str, Any]]:
        """Every ParityPolicy: listed once (and again after each periodic resync), then kept by the watch."""
        with self._guard:
            if self._policies is not None:
                return list(self._policies.values())
        listed = responses.body(self.custom.list_cluster_custom_object(*POLICIES, _preload_content=False))["items"]
        with self._guard:
            self._policies = {policy["metadata"]["name"]: policy for policy in listed}
        return list(listed)

    def _namespace(self, name: str) -> dict[str, Any]:
        """The namespace (its labels select ParityPolicies), read once per periodic resync."""
        with self._guard:
            cached = self._namespaces.get(name)
        if cached is None:
            cached = responses.body(self.core.read_namespace(name, _preload_content=False))
            with self._guard:
                self._namespaces[name] = cached
        return cached

    def _forget(self, key: JobKey) -> None:
        """The job is gone: drop what the operator kept about it."""
        for kept in (
            self._applied_children,
            self._rejected,
            self._taken,
            self._own_writes,
            self._gates,
            self._ack_order,
            self._jobs,
            self._pods,
        ):
            kept.pop(key, None)
        self._children_deleted.discard(key)
        _, timer = self._timers.pop(key, (0.0, None))
        if timer is not None:
            timer.cancel()

    def _apply(self, key: JobKey, job: dict[str, Any], plan: Plan) -> None:
        namespace, name = key
        rejected: dict[str, str] = {}
        children_hash = json.dumps([plan.children, plan.remove_children], sort_keys=True)
        # A pod about to be created needs its children (its ConfigMap, its Role): apply them first, whatever the cache.
        if plan.children and (plan.create_pods or self._applied_children.get(key) != children_hash):
            with self._guard:
                self._children_deleted.discard(key)
            for child in plan.children:
                rejected.update(
                    _refused(f"{child['kind']} {child['metadata']['name']}", self._server_side_apply, child)
                )
            for kind, child_name in plan.remove_children:
                _ignore(404, CHILD_DELETERS[kind](self), child_name, namespace)
            with self._guard:
                if not rejected and key not in self._children_deleted:
                    self._applied_children[key] = children_hash
        for pod_name, why in plan.delete_pods.items():
            logger.info("deleting pod %s/%s: %s", namespace, pod_name, why)
        self._expect_writes(key, plan)
        # Pod writes are independent of one another: send them side by side, without decoding the answers.
        calls = [
            *((self.core.delete_namespaced_pod, pod_name, namespace) for pod_name in plan.delete_pods),
            *(
                (self.core.patch_namespaced_pod, pod_name, namespace, {"metadata": {"annotations": values}})
                for pod_name, values in plan.annotate_pods.items()
            ),
        ]
        list(self._pods_pool.map(lambda call: _write_pod(*call), calls))
        for workload, patch in plan.workload_status.items():
            # A conflict (409) means Kueue wrote the Workload meanwhile: its watch event asks for another pass.
            _ignore(
                409,
                self.custom.patch_namespaced_custom_object_status,
                kueue.GROUP,
                kueue.VERSION,
                namespace,
                kueue.WORKLOADS,
                workload,
                patch,
                _content_type="application/merge-patch+json",
            )
        creations = [] if rejected else plan.create_pods
        for refusal in self._pods_pool.map(lambda pod: self._create_pod(key, pod), creations):
            rejected.update(refusal)
        with self._guard:
            taken = [p["metadata"]["name"] for p in creations if p["metadata"]["name"] in self._taken.get(key, {})]
        if taken:
            logger.warning("pods not labelled as RLJob %s/%s's hold names it needs: %s", namespace, name, taken)
        if rejected:
            logger.warning("the API server refused what RLJob %s/%s asks for: %s", namespace, name, rejected)
            self._rejected[key] = (job["metadata"].get("generation"), rejected)
            self._namespaces.pop(namespace, None)  # it may be terminating: read it again
        if rejected or taken:
            with self._guard:
                self._ask_again(key)  # at once, one more pass reports it on the job instead of this pass's status
            return
        if not self._write_status(key, job, plan.status):
            with self._guard:
                self._gates.pop(key, None)
                self._jobs.pop(key, None)  # read it anew
                self._ask_again(key)  # the job changed since: one more pass, which posts the Events
            return
        self._open_gate(key, plan)
        for event in plan.events:
            self._post_event(job, event.type, event.reason, event.message)
        if plan.delete_job:
            logger.info("deleting RLJob %s/%s: ttlSecondsAfterFinished passed", namespace, name)
            _ignore(
                404, self.custom.delete_namespaced_custom_object, api.GROUP, api.VERSION, namespace, api.RLJOBS, name
            )
        elif plan.requeue_after is not None:
            self._wake_in(key, plan.requeue_after)

    def _open_gate(self, key: JobKey, plan: Plan) -> None:
        """Wait for the acks the open barrier phase still needs; the acks that came in while the pass ran are
        judged at once (a pass only when one needs it)."""
        barrier = plan.status.barrier
        with self._guard:
            if barrier is None or plan.waiting_for is None:
                self._gates.pop(key, None)
                return
            gate = AckGate(barrier.id, barrier.phase, dict(barrier.retries), set(plan.waiting_for))
            pods = self._pods.get(key, PodCache()).pods
            verdicts = {
                gate.on_ack(pod, annotation(pods[pod], keys.BARRIER_ACK)) for pod in plan.waiting_for & set(pods)
            }
            self._gates[key] = gate
            if AckVerdict.NEEDS_PASS in verdicts:
                self._ask_again(key, PassScope.BARRIER)

    def _write_status(self, key: JobKey, job: dict[str, Any], status: RLJobStatus) -> bool:
        """Write what changed in the status as a merge patch, on the resourceVersion it was computed from;
        False when the job changed meanwhile (409)."""
        new = status.model_dump(mode="json", by_alias=True, exclude_none=True)
        changes = merge_patch(job.get("status") or {}, new)
        if not changes:
            return True
        namespace, name = key
        body = {"metadata": {"resourceVersion": job["metadata"]["resourceVersion"]}, "status": changes}
        try:
            written = self.custom.patch_namespaced_custom_object_status(
                api.GROUP,
                api.VERSION,
                namespace,
                api.RLJOBS,
                name,
                body,
                _content_type="application/merge-patch+json",
                _preload_content=False,
            )
        except ApiException as error:
            if error.status != 409:
                raise
            return False
        written_job = responses.body(written)
        written_job["metadata"].pop("managedFields", None)
        self._own_writes[key] = written_job["metadata"]["resourceVersion"]
        self._keep_job(key, written_job)
        return True

    def _expect_writes(self, key: JobKey, plan: Plan) -> None:
        """Record the pod annotations and deletions about to be written: the next pass sees them before their
        echo comes back from the watch, and the echo asks for no pass."""
        now = dt.datetime.now(dt.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
        with self._guard:
            cache = self._pods.setdefault(key, PodCache())
            for pod, values in plan.annotate_pods.items():
                cache.annotate(pod, values)
            for pod in plan.delete_pods:
                cache.deleting(pod, now)

    def _create_pod(self, key: JobKey, pod: dict[str, Any]) -> dict[str, str]:
        """Create ``pod`` and keep the API server's answer; ``_refused``'s verdict. A pod that exists already
        is the job's own, still terminating (the cache has it: its deletion asks for the next pass) or not yet
        brought by the watch (then the next pass lists the job's pods again); or it is not labelled as the
        job's (someone else's, or relabelled): it is kept in ``_taken`` for the next pass to report."""
        name = pod["metadata"]["name"]
        try:
            body: Any = pod  # the client sends a dict as it is
            created = responses.body(self.core.create_namespaced_pod(key[0], body, _preload_content=False))
        except ApiException as error:
            if error.status == 409:
                with self._guard:
                    cached = name in self._pods.setdefault(key, PodCache()).pods
                found = None if cached else self._read_pod(key[0], name)
                with self._guard:
                    if found is not None and not _labelled_as_of(found, key[1]):
                        self._taken.setdefault(key, {})[name] = found["metadata"]
                    elif not cached:
                        self._pods.setdefault(key, PodCache()).listed = False
            return _refusal(f"Pod {name}", error)
        with self._guard:
            self._pods.setdefault(key, PodCache()).observe("ADDED", created)
        return {}

    def _read_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The pod as the API server has it, or None when it is gone."""
        try:
            return responses.body(self.core.read_namespaced_pod(name, namespace, _preload_content=False))
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    def _wake_in(self, key: JobKey, seconds: float) -> None:
        """One timer per job: a pass of the whole pipeline ``seconds`` from now, unless one is due sooner (a pass
        of the barrier step alone knows only the barrier's deadline; one that wakes early finds nothing to do)."""
        now = time.monotonic()
        due = now + seconds
        with self._guard:
            kept_due, kept = self._timers.get(key, (0.0, None))
            if kept is not None and now < kept_due <= due:
                return
            timer = threading.Timer(seconds, self.request, key)
            timer.daemon = True
            self._timers[key] = (due, timer)
        if kept is not None:
            kept.cancel()
        timer.start()

    def _server_side_apply(self, child: dict[str, Any]) -> None:
        namespace, name = child["metadata"]["namespace"], child["metadata"]["name"]
        patchers: dict[str, Callable[..., Any]] = {
            "ConfigMap": self.core.patch_namespaced_config_map,
            "Service": self.core.patch_namespaced_service,
            "ServiceAccount": self.core.patch_namespaced_service_account,
            "Role": self.rbac.patch_namespaced_role,
            "RoleBinding": self.rbac.patch_namespaced_role_binding,
            "NetworkPolicy": self.networking.patch_namespaced_network_policy,
            kueue.WORKLOAD: self._patch_workload,
        }
        patchers[child["kind"]](
            name,
            namespace,
            child,
            field_manager=FIELD_MANAGER,
            force=True,
            _content_type="application/apply-patch+yaml",
        )

    def _delete_workload(self, name: str, namespace: str) -> None:
        self.custom.delete_namespaced_custom_object(kueue.GROUP, kueue.VERSION, namespace, kueue.WORKLOADS, name)

    def _patch_workload(self, name: str, namespace: str, body: dict[str, Any], **options: Any) -> None:
        self.custom.patch_namespaced_custom_object(
            kueue.GROUP, kueue.VERSION, namespace, kueue.WORKLOADS, name, body, **options
        )

    def _post_event(self, job: dict[str, Any], type_: str, reason: str, message: str) -> None:
        """Post an Event on the job; one that cannot be posted (its namespace is being deleted) is only logged."""
        try:
            self._create_event(job, type_, reason, message)
        except ApiException as error:
            logger.warning("could not post Event %s on RLJob %s: %s", reason, job["metadata"]["name"], error.reason)

    def _create_event(self, job: dict[str, Any], type_: str, reason: str, message: str) -> None:
        now = dt.datetime.now(dt.UTC)
        metadata = job["metadata"]
        self.core.create_namespaced_event(
            metadata["namespace"],
            client.CoreV1Event(
                metadata=client.V1ObjectMeta(generate_name=f"{metadata['name']}."),
                involved_object=client.V1ObjectReference(
                    api_version=api.API_VERSION,
                    kind="RLJob",
                    name=metadata["name"],
                    namespace=metadata["namespace"],
                    uid=metadata["uid"],
                ),
                type=type_,
                reason=reason,
                message=message[:1024],
                source=client.V1EventSource(component=FIELD_MANAGER),
                reporting_component=FIELD_MANAGER,
                reporting_instance=FIELD_MANAGER,
                first_timestamp=now,
                last_timestamp=now,
                count=1,
            ),
        )


def _refused(what: str, call: Any, *args: Any) -> dict[str, str]:
    """Call; when the API server refuses the object (400 or 422: invalid; 403: an admission policy, a quota),
    ``{what: its message}``. An object that already exists (409) is fine; other errors raise."""
    try:
        call(*args)
    except ApiException as error:
        return _refusal(what, error)
    return {}


def _refusal(what: str, error: ApiException) -> dict[str, str]:
    """``_refused``'s verdict on the API server's ``error``: {what: its message}, {} for 409, or raise it."""
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


def _older(job: dict[str, Any], than: dict[str, Any]) -> bool:
    """Whether ``job`` is an older version of the same object than ``than``."""
    version, kept = revision(job), revision(than)
    return version is not None and kept is not None and version < kept


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


def _write_pod(call: Callable[..., Any], *args: Any) -> None:
    """A pod delete or patch: a pod already gone is fine; 429 and 5xx are tried again with a backoff."""
    for attempt in range(WRITE_ATTEMPTS):
        try:
            response = call(*args, _preload_content=False)
            # Read the answer to its end, undecoded: only then does its connection go back to the pool (a
            # new connection costs a TLS handshake, on both sides; at 1024 actors most of a barrier's CPU).
            response.drain_conn()
            response.release_conn()
            return
        except ApiException as error:
            if error.status == 404:
                return
            if (error.status != 429 and error.status < 500) or attempt == WRITE_ATTEMPTS - 1:
                raise
        time.sleep(0.1 * 2**attempt)


def _ignore(status: int, call: Any, *args: Any, **options: Any) -> None:
    try:
        call(*args, **options)
    except ApiException as error:
        if error.status != status:
            raise


# -- kopf wiring -----------------------------------------------------------------------

_shell: Shell | None = None
_stopping = threading.Event()
_options = argparse.Namespace(restart_backoff_seconds=10.0, kueue=False)


def shell() -> Shell:
    assert _shell is not None, "the operator has not started"
    return _shell


@kopf.on.startup()
def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
    global _shell
    configuration = client.Configuration.get_default_copy()  # main() loaded the credentials
    configuration.connection_pool_maxsize = POD_WRITERS + 4  # the pod writers, plus the reconcile passes
    _shell = Shell(
        client.ApiClient(configuration), backoff_base_seconds=_options.restart_backoff_seconds, kueue=_options.kueue
    )
    # The pods this operator created: one watch of its own (lockstep.podwatch), filtered by the API server.
    pods = PodWatch(
        client.CoreV1Api(client.ApiClient(configuration)), keys.POD_SELECTOR, _shell.pods_listed, _shell.pod_changed
    )
    threading.Thread(target=pods.run, args=(_stopping,), name="pod-watch", daemon=True).start()
    for group, _version, plural in WATCHED_CHILDREN:
        settings.watching.label_selectors[group, plural] = keys.POD_SELECTOR
    # Lockstep posts its own Events; kopf's per-handler log Events would only be noise.
    settings.posting.enabled = False
    # A periodic pass over every job, in case an event was missed. Not a kopf timer: kopf puts a
    # finalizer on every object with a timer, and an RLJob must never wait on the operator to go away.
    threading.Thread(target=_resync_periodically, name="resync", daemon=True).start()


def _resync_periodically() -> None:
    while not _stopping.wait(SAFETY_NET_SECONDS):
        try:
            shell().request_all()
        except Exception:
            logger.exception("the periodic resync failed; retrying in %.0f s", SAFETY_NET_SECONDS)


@kopf.on.cleanup()
def cleanup(**_: Any) -> None:
    _stopping.set()


@kopf.on.event(*RLJOBS)
def rljob_changed(
    type: str | None, namespace: str | None, name: str, meta: Mapping[str, Any], body: Mapping[str, Any], **_: Any
) -> None:
    if not namespace:
        return
    shell().job_event(namespace, name, None if type == "DELETED" else _plain(body))
    if type != "DELETED" and not shell().caused_by_own_write(namespace, name, meta.get("resourceVersion")):
        shell().request(namespace, name)


CHILD_DELETERS = {
    "NetworkPolicy": lambda shell: shell.networking.delete_namespaced_network_policy,
    kueue.WORKLOAD: lambda shell: shell._delete_workload,
}
"""Children the operator removes when the spec no longer asks for them."""
WATCHED_CHILDREN = (
    ("", "v1", "services"),
    ("", "v1", "serviceaccounts"),
    ("rbac.authorization.k8s.io", "v1", "roles"),
    ("rbac.authorization.k8s.io", "v1", "rolebindings"),
    ("networking.k8s.io", "v1", "networkpolicies"),
)
"""Children whose deletion is noticed at once (a label-selected watch) and undone: pods rely on them while they
run. The ConfigMap is not watched (that would mean reading every ConfigMap in the cluster): it is applied again
before any pod is created, and on the periodic resync."""


def _child_deleted(type: str, namespace: str | None, labels: Mapping[str, str], **_: Any) -> None:
    job = labels.get(keys.JOB)
    if type == "DELETED" and job and namespace:
        shell().child_deleted(namespace, job)


for _group, _version, _plural in WATCHED_CHILDREN:
    kopf.on.event(_group, _version, _plural, labels={keys.MANAGED_BY: keys.MANAGER})(_child_deleted)


def _workload_changed(type: str | None, namespace: str | None, labels: Mapping[str, str], **_: Any) -> None:
    """Kueue admitted, evicted or requeued a job's Workload (or it was deleted: it is created again)."""
    job = labels.get(keys.JOB)
    if job and namespace:
        if type == "DELETED":
            shell().child_deleted(namespace, job)
        else:
            shell().request(namespace, job)


@kopf.on.event(*POLICIES)
def policy_changed(type: str | None, name: str, body: Mapping[str, Any], **_: Any) -> None:
    shell().policy_event(name, None if type == "DELETED" else _plain(body))
    shell().request_all()


def _plain(body: Mapping[str, Any]) -> dict[str, Any]:
    """A plain JSON copy of an object kopf delivered, without its managedFields (nothing here reads them)."""
    copy: dict[str, Any] = json.loads(json.dumps(dict(body)))
    copy["metadata"].pop("managedFields", None)
    return copy


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lockstep.controller", description=__doc__.splitlines()[0])
    parser.add_argument("--liveness", metavar="URL", help="serve a liveness probe, e.g. http://0.0.0.0:8080/healthz")
    parser.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port (all addresses)")
    parser.add_argument(
        "--restart-backoff-seconds",
        type=float,
        default=10.0,
        help="first wait before recreating failed pods; doubles per restart, capped at 5 minutes",
    )
    parser.add_argument(
        "--leader-election",
        action="store_true",
        help="reconcile only while holding a Lease, so that several replicas can run (one acts, the others stand by)",
    )
    parser.add_argument(
        "--leader-election-namespace",
        default=keys.OPERATOR_NAMESPACE,
        help="namespace of the leader election Lease (default: %(default)s)",
    )
    parser.add_argument(
        "--leader-election-id",
        default=leader.LEASE_NAME,
        help="name of the leader election Lease (default: %(default)s)",
    )
    parser.add_argument(
        "--kueue",
        action="store_true",
        help="let Kueue (installed in the cluster, with RLJob in its integrations.externalFrameworks) queue and admit "
        f"jobs labelled {kueue.QUEUE_LABEL}: each as one Workload, a gang of its pods",
    )
    options = parser.parse_args(argv, namespace=_options)
    if options.kueue:
        kopf.on.event(*WORKLOADS, labels={keys.MANAGED_BY: keys.MANAGER})(_workload_changed)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # kopf's line per handled event ("Handler 'pod_changed' succeeded.") is noise: thousands per barrier at scale.
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    if options.metrics_port:
        prometheus_client.start_http_server(options.metrics_port)
    elector = None
    if options.leader_election:
        # Stand by, answering only the liveness probe, until this replica holds the Lease.
        elector = leader.LeaderElector(
            client.ApiClient(), options.leader_election_namespace, options.leader_election_id, leader.identity()
        )
        with leader.liveness_while_standing_by(options.liveness):
            elector.acquire()
    kopf.run(clusterwide=True, standalone=True, liveness_endpoint=options.liveness)
    if elector is not None:
        elector.release()  # kopf has stopped handling events; the process ends right after


if __name__ == "__main__":
    main()
