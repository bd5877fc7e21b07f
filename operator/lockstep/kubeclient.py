"""The operator's calls to the API server, in the shapes its parts ask for (lockstep.world.WorldClient,
lockstep.applier.ApplierClient): answers read as JSON (lockstep.responses), not built into the client's models;
pod writes sent undecoded and tried again on 429 and 5xx.

Reads answer None for an object that is not there, and deletes take one that is gone already for done; any other
error raises the client's ApiException.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from lockstep import api, desired, keys, kueue, responses

RLJOBS = (api.GROUP, api.VERSION, api.RLJOBS)
POLICIES = (api.GROUP, api.VERSION, api.PARITY_POLICIES)
WORKLOADS = (kueue.GROUP, kueue.VERSION, kueue.WORKLOADS)
FIELD_MANAGER = keys.FIELD_MANAGER
WRITE_ATTEMPTS = 4
"""Tries of one pod write that the API server answered 429 or 5xx, with a backoff of 0.1 s, 0.2 s, 0.4 s."""
MERGE_PATCH = "application/merge-patch+json"


class KubeClient:
    """The kubernetes client's API objects (core, custom, rbac, networking) behind the few calls the operator makes."""

    def __init__(self, api_client: client.ApiClient) -> None:
        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self.rbac = client.RbacAuthorizationV1Api(api_client)
        self.networking = client.NetworkingV1Api(api_client)
        self.apps = client.AppsV1Api(api_client)

    # -- reads (lockstep.world.WorldClient) ------------------------------------------------

    def list_jobs(self) -> list[dict[str, Any]]:
        listed = self.custom.list_cluster_custom_object(*RLJOBS, _preload_content=False)
        items: list[dict[str, Any]] = responses.body(listed)["items"]
        return items

    def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        return _absent_as_none(
            lambda: self.custom.get_namespaced_custom_object(
                api.GROUP, api.VERSION, namespace, api.RLJOBS, name, _preload_content=False
            )
        )

    def list_job_pods(self, namespace: str, job: str) -> dict[str, Any]:
        return responses.body(
            self.core.list_namespaced_pod(
                namespace, label_selector=f"{keys.POD_SELECTOR},{keys.JOB}={job}", _preload_content=False
            )
        )

    def list_policies(self) -> list[dict[str, Any]]:
        listed = self.custom.list_cluster_custom_object(*POLICIES, _preload_content=False)
        items: list[dict[str, Any]] = responses.body(listed)["items"]
        return items

    def read_namespace(self, name: str) -> dict[str, Any]:
        return responses.body(self.core.read_namespace(name, _preload_content=False))

    def list_workloads(self, namespace: str, job: str) -> list[dict[str, Any]]:
        listed = self.custom.list_namespaced_custom_object(
            kueue.GROUP,
            kueue.VERSION,
            namespace,
            kueue.WORKLOADS,
            label_selector=f"{keys.POD_SELECTOR},{keys.JOB}={job}",
            _preload_content=False,
        )
        items: list[dict[str, Any]] = responses.body(listed)["items"]
        return items

    def list_resource_flavors(self) -> list[dict[str, Any]]:
        listed = self.custom.list_cluster_custom_object(
            kueue.GROUP, kueue.VERSION, kueue.RESOURCE_FLAVORS, _preload_content=False
        )
        items: list[dict[str, Any]] = responses.body(listed)["items"]
        return items

    def get_priority_class(self, name: str) -> dict[str, Any] | None:
        return _absent_as_none(
            lambda: self.custom.get_cluster_custom_object(
                kueue.GROUP, kueue.VERSION, kueue.PRIORITY_CLASSES, name, _preload_content=False
            )
        )

    def read_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        return _absent_as_none(lambda: self.core.read_namespaced_pod(name, namespace, _preload_content=False))

    def read_stateful_set(self, namespace: str, name: str) -> dict[str, Any] | None:
        return _absent_as_none(lambda: self.apps.read_namespaced_stateful_set(name, namespace, _preload_content=False))

    def read_group_set(self, namespace: str, name: str) -> dict[str, Any] | None:
        """None also when the operator may not read LeaderWorkerSets (the chart's leaderWorkerSet.enabled is off):
        then none is the job's, and applying one is refused in the job's status."""
        try:
            return _absent_as_none(
                lambda: self.custom.get_namespaced_custom_object(*_group_set(namespace, name), _preload_content=False)
            )
        except ApiException as error:
            if error.status == 403:
                return None
            raise

    # -- writes (lockstep.applier.ApplierClient) -------------------------------------------

    def apply(self, child: dict[str, Any]) -> None:
        namespace, name = child["metadata"]["namespace"], child["metadata"]["name"]
        patchers: dict[str, Callable[..., Any]] = {
            "ConfigMap": self.core.patch_namespaced_config_map,
            "Service": self.core.patch_namespaced_service,
            "ServiceAccount": self.core.patch_namespaced_service_account,
            "Role": self.rbac.patch_namespaced_role,
            "RoleBinding": self.rbac.patch_namespaced_role_binding,
            "NetworkPolicy": self.networking.patch_namespaced_network_policy,
            kueue.WORKLOAD: self._patch_workload,
            desired.LEADER_WORKER_SET: self._patch_group_set,
        }
        patchers[child["kind"]](
            name,
            namespace,
            child,
            field_manager=FIELD_MANAGER,
            force=True,
            _content_type="application/apply-patch+yaml",
        )

    def delete_child(self, kind: str, namespace: str, name: str) -> None:
        """Delete a child the spec no longer asks for: a NetworkPolicy, a Kueue Workload, or the LeaderWorkerSet of
        a job whose pods stop (its pods go with it)."""
        deleters: dict[str, Callable[..., Any]] = {
            "NetworkPolicy": self.networking.delete_namespaced_network_policy,
            kueue.WORKLOAD: self._delete_workload,
            desired.LEADER_WORKER_SET: self._delete_group_set,
        }
        _ignore(404, deleters[kind], name, namespace)

    def delete_pod(self, namespace: str, name: str) -> None:
        write_pod(self.core.delete_namespaced_pod, name, namespace)

    def annotate_pod(self, namespace: str, name: str, values: dict[str, str]) -> None:
        write_pod(self.core.patch_namespaced_pod, name, namespace, {"metadata": {"annotations": values}})

    def create_pod(self, namespace: str, pod: dict[str, Any]) -> dict[str, Any]:
        body: Any = pod  # the client sends a dict as it is
        return responses.body(self.core.create_namespaced_pod(namespace, body, _preload_content=False))

    def patch_workload_status(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object_status(
            kueue.GROUP, kueue.VERSION, namespace, kueue.WORKLOADS, name, patch, _content_type=MERGE_PATCH
        )

    def patch_job_status(self, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        written = self.custom.patch_namespaced_custom_object_status(
            api.GROUP,
            api.VERSION,
            namespace,
            api.RLJOBS,
            name,
            patch,
            _content_type=MERGE_PATCH,
            _preload_content=False,
        )
        return responses.body(written)

    def post_event(self, job: dict[str, Any], type_: str, reason: str, message: str) -> None:
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

    def delete_job(self, namespace: str, name: str) -> None:
        _ignore(404, self.custom.delete_namespaced_custom_object, api.GROUP, api.VERSION, namespace, api.RLJOBS, name)

    def _delete_workload(self, name: str, namespace: str) -> None:
        self.custom.delete_namespaced_custom_object(kueue.GROUP, kueue.VERSION, namespace, kueue.WORKLOADS, name)

    def _patch_workload(self, name: str, namespace: str, body: dict[str, Any], **options: Any) -> None:
        self.custom.patch_namespaced_custom_object(
            kueue.GROUP, kueue.VERSION, namespace, kueue.WORKLOADS, name, body, **options
        )

    def _patch_group_set(self, name: str, namespace: str, body: dict[str, Any], **options: Any) -> None:
        self.custom.patch_namespaced_custom_object(*_group_set(namespace, name), body, **options)

    def _delete_group_set(self, name: str, namespace: str) -> None:
        self.custom.delete_namespaced_custom_object(*_group_set(namespace, name))


def _group_set(namespace: str, name: str) -> tuple[str, str, str, str, str]:
    """A job's LeaderWorkerSet, as the custom-object calls name it: group, version, namespace, plural, name."""
    return (
        desired.LEADER_WORKER_SET_GROUP,
        desired.LEADER_WORKER_SET_VERSION,
        namespace,
        desired.LEADER_WORKER_SETS,
        name,
    )


def write_pod(call: Callable[..., Any], *args: Any) -> None:
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


def _absent_as_none(read: Callable[[], Any]) -> dict[str, Any] | None:
    """The JSON body of ``read()`` (a call made with ``_preload_content=False``), None when it answers 404."""
    try:
        return responses.body(read())
    except ApiException as error:
        if error.status == 404:
            return None
        raise


def _ignore(status: int, call: Callable[..., Any], *args: Any) -> None:
    try:
        call(*args)
    except ApiException as error:
        if error.status != status:
            raise
