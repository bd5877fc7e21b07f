"""The operator's imperative shell: kopf handlers that read, call the pure reconciler, apply.

Run it with ``python -m lockstep.controller`` (uses $KUBECONFIG, or the in-cluster service account).

Every trigger (an RLJob event, an event of one of the operator's own pods, a ParityPolicy
change, a requeue) asks for a reconcile of one job. Requests for a job that is being
reconciled are coalesced into one more pass, so a burst of pod events costs one pass, not
hundreds; status is written with the resourceVersion it was computed from (a conflict
means another pass).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import kopf
import prometheus_client
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from lockstep import api, keys, metrics
from lockstep.api import RLJobStatus
from lockstep.reconcile import Observed, Plan, reconcile

RLJOBS = (api.GROUP, api.VERSION, api.RLJOBS)
POLICIES = (api.GROUP, api.VERSION, api.PARITY_POLICIES)
FIELD_MANAGER = "lockstep-operator"
SAFETY_NET_SECONDS = 60.0
POD_WRITERS = 16

logger = logging.getLogger("lockstep.controller")
JobKey = tuple[str, str]  # (namespace, name)


def _json(response: Any) -> Any:
    return json.loads(response.data)


class Shell:
    """Reads a job's world from the API server, reconciles it, and applies the plan."""

    def __init__(self, api_client: client.ApiClient, backoff_base_seconds: float = 10.0) -> None:
        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self.rbac = client.RbacAuthorizationV1Api(api_client)
        self.backoff_base_seconds = backoff_base_seconds
        self._guard = threading.Lock()
        self._running: set[JobKey] = set()
        self._dirty: set[JobKey] = set()
        self._applied_children: dict[JobKey, str] = {}
        self._own_writes: dict[JobKey, str] = {}  # the resourceVersion of each job's last status write
        self._pods_pool = ThreadPoolExecutor(max_workers=POD_WRITERS, thread_name_prefix="pod-writer")

    # -- coalescing ----------------------------------------------------------------------

    def request(self, namespace: str, name: str) -> None:
        """Reconcile the job now, or once more right after the pass already running for it."""
        key = (namespace, name)
        with self._guard:
            if key in self._running:
                self._dirty.add(key)
                return
            self._running.add(key)
        try:
            while True:
                with metrics.RECONCILE_SECONDS.time():
                    self._reconcile_once(key)
                with self._guard:
                    if key not in self._dirty:
                        return
                    self._dirty.discard(key)
        except Exception:
            metrics.RECONCILE_ERRORS.inc()
            raise
        finally:
            with self._guard:
                self._running.discard(key)

    def caused_by_own_write(self, namespace: str, name: str, resource_version: str | None) -> bool:
        """Whether an RLJob event only reports this operator's own status write (nothing new to act on)."""
        return resource_version is not None and self._own_writes.get((namespace, name)) == resource_version

    def request_all(self) -> None:
        """Reconcile every RLJob in the cluster (after a ParityPolicy changed)."""
        jobs = _json(self.custom.list_cluster_custom_object(*RLJOBS, _preload_content=False))["items"]
        for job in jobs:
            self.request(job["metadata"]["namespace"], job["metadata"]["name"])

    # -- one pass ------------------------------------------------------------------------

    def _reconcile_once(self, key: JobKey) -> None:
        namespace, name = key
        try:
            job = _json(
                self.custom.get_namespaced_custom_object(
                    api.GROUP, api.VERSION, namespace, api.RLJOBS, name, _preload_content=False
                )
            )
        except ApiException as error:
            if error.status == 404:
                self._applied_children.pop(key, None)
                self._own_writes.pop(key, None)
                metrics.forget(namespace, name)
                return
            raise
        pods = _json(
            self.core.list_namespaced_pod(
                namespace, label_selector=f"{keys.POD_SELECTOR},{keys.JOB}={name}", _preload_content=False
            )
        )["items"]
        policies = _json(self.custom.list_cluster_custom_object(*POLICIES, _preload_content=False))["items"]
        labels = _json(self.core.read_namespace(namespace, _preload_content=False))["metadata"].get("labels", {})
        plan = reconcile(Observed(job, pods, policies, labels, dt.datetime.now(dt.UTC), self.backoff_base_seconds))
        before = RLJobStatus.model_validate(job.get("status") or {})
        self._apply(key, job, plan)
        metrics.record(namespace, name, before, plan.status)

    def _apply(self, key: JobKey, job: dict[str, Any], plan: Plan) -> None:
        namespace, name = key
        children_hash = json.dumps(plan.children, sort_keys=True)
        if plan.children and self._applied_children.get(key) != children_hash:
            for child in plan.children:
                self._server_side_apply(child)
            self._applied_children[key] = children_hash
        for pod_name, why in plan.delete_pods.items():
            logger.info("deleting pod %s/%s: %s", namespace, pod_name, why)
        # Pod writes are independent of one another: send them side by side.
        calls = [
            *((404, self.core.delete_namespaced_pod, pod_name, namespace) for pod_name in plan.delete_pods),
            *(
                (404, self.core.patch_namespaced_pod, pod_name, namespace, {"metadata": {"annotations": values}})
                for pod_name, values in plan.annotate_pods.items()
            ),
            *((409, self.core.create_namespaced_pod, namespace, pod) for pod in plan.create_pods),
        ]
        list(self._pods_pool.map(lambda call: _ignore(*call), calls))
        new_status = plan.status.model_dump(mode="json", by_alias=True, exclude_none=True)
        if new_status != job.get("status"):
            job["status"] = new_status
            try:
                written = self.custom.replace_namespaced_custom_object_status(
                    api.GROUP, api.VERSION, namespace, api.RLJOBS, name, job, _preload_content=False
                )
                self._own_writes[key] = _json(written)["metadata"]["resourceVersion"]
            except ApiException as error:
                if error.status != 409:
                    raise
                with self._guard:
                    self._dirty.add(key)  # the job changed since we read it: one more pass
        for event in plan.events:
            self._post_event(job, event.type, event.reason, event.message)
        if plan.delete_job:
            logger.info("deleting RLJob %s/%s: ttlSecondsAfterFinished passed", namespace, name)
            _ignore(
                404, self.custom.delete_namespaced_custom_object, api.GROUP, api.VERSION, namespace, api.RLJOBS, name
            )
        elif plan.requeue_after is not None:
            timer = threading.Timer(plan.requeue_after, self.request, key)
            timer.daemon = True
            timer.start()

    def _server_side_apply(self, child: dict[str, Any]) -> None:
        namespace, name = child["metadata"]["namespace"], child["metadata"]["name"]
        patch = {
            "ConfigMap": self.core.patch_namespaced_config_map,
            "Service": self.core.patch_namespaced_service,
            "ServiceAccount": self.core.patch_namespaced_service_account,
            "Role": self.rbac.patch_namespaced_role,
            "RoleBinding": self.rbac.patch_namespaced_role_binding,
        }[child["kind"]]
        patch(
            name,
            namespace,
            child,
            field_manager=FIELD_MANAGER,
            force=True,
            _content_type="application/apply-patch+yaml",
        )

    def _post_event(self, job: dict[str, Any], type_: str, reason: str, message: str) -> None:
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


def _ignore(status: int, call: Any, *args: Any) -> None:
    try:
        call(*args)
    except ApiException as error:
        if error.status != status:
            raise


# -- kopf wiring -----------------------------------------------------------------------

_shell: Shell | None = None
_stopping = threading.Event()
_options = argparse.Namespace(restart_backoff_seconds=10.0)


def shell() -> Shell:
    assert _shell is not None, "the operator has not started"
    return _shell


@kopf.on.startup()
def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
    global _shell
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    configuration = client.Configuration.get_default_copy()
    configuration.connection_pool_maxsize = POD_WRITERS + 4  # the pod writers, plus the reconcile passes
    _shell = Shell(client.ApiClient(configuration), backoff_base_seconds=_options.restart_backoff_seconds)
    # Only the pods this operator created, filtered by the API server.
    settings.watching.label_selectors["pods"] = keys.POD_SELECTOR
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
def rljob_changed(type: str, namespace: str | None, name: str, meta: Mapping[str, Any], **_: Any) -> None:
    if type == "DELETED" or not namespace:
        return
    if not shell().caused_by_own_write(namespace, name, meta.get("resourceVersion")):
        shell().request(namespace, name)


@kopf.on.event("", "v1", "pods", labels={keys.MANAGED_BY: keys.MANAGER})
def pod_changed(labels: Mapping[str, str], namespace: str | None, **_: Any) -> None:
    job = labels.get(keys.JOB)
    if job and namespace:
        shell().request(namespace, job)


@kopf.on.event(*POLICIES)
def policy_changed(**_: Any) -> None:
    shell().request_all()


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
    options = parser.parse_args(argv, namespace=_options)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if options.metrics_port:
        prometheus_client.start_http_server(options.metrics_port)
    kopf.run(clusterwide=True, standalone=True, liveness_endpoint=options.liveness)


if __name__ == "__main__":
    main()
