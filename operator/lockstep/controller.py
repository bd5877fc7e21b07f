"""The operator's imperative shell: kopf handlers (and a pod watch of its own) that ask for passes, and the
``Shell`` that runs them from three parts, each with one job: the ``World`` (lockstep.world: what the watches
delivered and the operator wrote), the ``WorkQueue`` (lockstep.workqueue: one pass at a time per job, coalesced,
one wake-up timer per job) and the ``Applier`` (lockstep.applier: a plan's writes in their order).

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
import json
import logging
import os
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import kopf
import prometheus_client
from kubernetes import client, config
from opentelemetry.trace import Tracer

from lockstep import barrier, keys, kueue, leader, metrics, tracing
from lockstep.api import RLJobStatus
from lockstep.applier import Applied, Applier, Conflict, Outcome, Rejected
from lockstep.events import JobKey, PassScope
from lockstep.kubeclient import POLICIES, RLJOBS, WORKLOADS, KubeClient
from lockstep.podwatch import PodWatch
from lockstep.reconcile import reconcile
from lockstep.workqueue import WorkQueue
from lockstep.world import Unobserved, World

SAFETY_NET_SECONDS = 60.0
POD_WRITERS = 16
PASS_WORKERS = 4
"""Passes that pod events ask for run on this many threads (one job's pass at a time, coalesced)."""

logger = logging.getLogger("lockstep.controller")


class Shell:
    """Reads a job's world, reconciles it, and applies the plan: one pass, as JobSet's Reconcile (observe,
    reconcile, apply, requeue), for every request the handlers make."""

    def __init__(
        self,
        api_client: client.ApiClient,
        backoff_base_seconds: float = 10.0,
        kueue: bool = False,
        tracer: Tracer | None = None,
        trainer_env: Mapping[str, str] | None = None,
    ) -> None:
        self.tracer = tracer
        """Where each closed barrier's trace goes (lockstep.tracing); None: nowhere."""
        self.kube = KubeClient(api_client)
        self.world = World(self.kube, backoff_base_seconds, kueue, trainer_env)
        pod_writers = ThreadPoolExecutor(max_workers=POD_WRITERS, thread_name_prefix="pod-writer")
        self.applier = Applier(self.kube, self.world, pod_writers)
        self.queue = WorkQueue(self._pass)
        self._passes = ThreadPoolExecutor(max_workers=PASS_WORKERS, thread_name_prefix="pass")

    # -- requests ------------------------------------------------------------------------

    def request(self, namespace: str, name: str, scope: PassScope = PassScope.FULL) -> None:
        """Reconcile the job now, or once more right after the pass already running for it (one pass for all the
        requests that came meanwhile, of the widest scope they asked for)."""
        self.queue.request((namespace, name), scope)

    def request_soon(self, namespace: str, name: str, scope: PassScope = PassScope.FULL) -> None:
        """Reconcile the job on a pass thread (the caller goes on); a pass that fails is logged."""
        self._passes.submit(self._request_logged, namespace, name, scope)

    def _request_logged(self, namespace: str, name: str, scope: PassScope = PassScope.FULL) -> None:
        try:
            self.request(namespace, name, scope)
        except Exception:
            logger.exception("reconciling RLJob %s/%s failed; its next event or resync tries again", namespace, name)

    def request_all(self) -> None:
        """Reconcile every RLJob in the cluster (after a ParityPolicy changed, and periodically), each job's
        children applied anew; one job that fails does not keep the others from their pass."""
        jobs = self.world.resync()
        self.applier.reapply_all()
        for job in jobs:
            namespace, name = job["metadata"]["namespace"], job["metadata"]["name"]
            self.world.job_event((namespace, name), job)  # newer than what is kept, if a watch event was missed
            self._request_logged(namespace, name)

    # -- what the watches deliver --------------------------------------------------------

    def job_event(self, namespace: str, name: str, job: dict[str, Any] | None) -> None:
        """Keep the job as its watch delivered it (None: deleted)."""
        self.world.job_event((namespace, name), job)

    def caused_by_own_write(self, namespace: str, name: str, resource_version: str | None) -> bool:
        """Whether an RLJob event only reports this operator's own status write (nothing new to act on)."""
        return self.world.caused_by_own_write((namespace, name), resource_version)

    def policy_event(self, name: str, policy: dict[str, Any] | None) -> None:
        """Keep the ParityPolicy as its watch delivered it (None: deleted)."""
        self.world.policy_event(name, policy)

    def pods_listed(self, pods: list[dict[str, Any]], revision: str) -> None:
        """The pod watch listed every Lockstep pod at ``revision``: each job's pods are these, and each job known
        here gets a pass."""
        for namespace, name in self.world.pods_listed(pods, revision):
            self.request_soon(namespace, name)

    def pod_changed(self, event: str, pod: dict[str, Any]) -> None:
        """The pod watch saw ``pod`` added, changed or deleted (``event``)."""
        metadata = pod["metadata"]
        job = (metadata.get("labels") or {}).get(keys.JOB)
        if job and metadata.get("namespace"):
            self.pod_event(metadata["namespace"], job, event, pod)

    def pod_event(self, namespace: str, job: str, event: str, pod: dict[str, Any]) -> None:
        """A pod of ``job`` was added, changed or deleted (``event``): a pass only when it needs one."""
        scope = self.world.pod_event((namespace, job), event, pod)
        if scope is not None:
            self.request_soon(namespace, job, scope)

    def child_deleted(self, namespace: str, job: str) -> None:
        """One of the job's children was deleted: apply them all again now."""
        self.applier.child_deleted((namespace, job))
        self.request(namespace, job)

    # -- one pass ------------------------------------------------------------------------

    def _pass(self, key: JobKey, scope: PassScope) -> None:
        """The work queue's work: one pass, timed; one that raises leaves the next pass a whole one."""
        try:
            with metrics.RECONCILE_SECONDS.time():
                self._reconcile_once(key, scope)
        except Exception:
            metrics.RECONCILE_ERRORS.inc()
            self.world.drop_gate(key)  # what the failed pass wrote is unknown
            raise

    def _reconcile_once(self, key: JobKey, scope: PassScope) -> None:
        observed = self.world.observe(key, scope)
        if observed is Unobserved.JOB_GONE:
            self._forget(key)
            metrics.forget(*key)
            return
        if isinstance(observed, Unobserved):
            return
        plan = reconcile(observed)
        before = RLJobStatus.model_validate(observed.job.get("status") or {})
        outcome = self.applier.apply(key, observed.job, plan)
        self._requeue(key, observed.job, outcome)
        metrics.record(*key, before, plan.status)
        if self.tracer is not None:
            for closed in barrier.closed_since(before.barrier_history, plan.status.barrier_history):
                acks = tracing.barrier_acks(observed.pods, closed.id)
                if (span := tracing.barrier_span(*key, closed, acks)) is not None:
                    tracing.emit(self.tracer, span)

    def _requeue(self, key: JobKey, job: dict[str, Any], outcome: Outcome) -> None:
        """Act on what the apply came to: a pass at once after a refusal or a conflict; after a written status, the
        open barrier phase's gate, the pass's Events and the job's wake-up."""
        match outcome:
            case Rejected(generation=generation, refused=refused):
                if refused:
                    self.world.refused(key, generation, refused)
                self.queue.again(key)  # at once, one more pass reports it on the job instead of this pass's status
            case Conflict():
                self.world.reread(key)
                self.queue.again(key)  # the job changed since: one more pass, which posts the Events
            case Applied(gate=gate, requeue_after=requeue_after):
                if self.world.open_gate(key, gate):
                    self.queue.again(key, PassScope.BARRIER)  # an ack that came while the pass ran needs one
                self.applier.announce(key, job, outcome)
                if requeue_after is not None:
                    self.queue.wake_in(key, requeue_after)

    def _forget(self, key: JobKey) -> None:
        """The job is gone: drop what the operator kept about it."""
        self.world.forget(key)
        self.applier.forget(key)
        self.queue.forget(key)


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
        client.ApiClient(configuration),
        backoff_base_seconds=_options.restart_backoff_seconds,
        kueue=_options.kueue,
        tracer=tracing.tracer(os.environ, tracing.OPERATOR_SERVICE),
        trainer_env=tracing.forwarded(os.environ),
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
