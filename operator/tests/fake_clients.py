"""Fakes of the operator's own small client interfaces (lockstep.world.WorldClient, lockstep.applier.ApplierClient),
for the unit tests of the shell's parts: objects in dicts, every call recorded in order, errors scripted. They stand
for lockstep.kubeclient.KubeClient, not for the Kubernetes API (the e2e tests run on a real control plane)."""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Callable
from typing import Any

from kubernetes.client.exceptions import ApiException

from lockstep import keys


def refusal(status: int, message: str = "") -> ApiException:
    """An error of the API server, as the kubernetes client raises it."""
    error = ApiException(status=status, reason={400: "Bad Request", 409: "Conflict", 422: "Invalid"}.get(status, ""))
    error.body = json.dumps({"message": message}) if message else None
    return error


class FakeWorldClient:
    """The reads of a World: jobs, pods, policies, namespaces and Kueue objects held here."""

    def __init__(self) -> None:
        self.jobs: dict[tuple[str, str], dict[str, Any]] = {}
        self.pods: dict[tuple[str, str], list[dict[str, Any]]] = {}
        self.policies: list[dict[str, Any]] = []
        self.namespaces: dict[str, dict[str, Any]] = {}
        self.workloads: list[dict[str, Any]] = []
        self.flavors: list[dict[str, Any]] = []
        self.priority_classes: dict[str, dict[str, Any]] = {}
        self.owners: dict[tuple[str, str, str], dict[str, Any]] = {}
        """StatefulSets and LeaderWorkerSets by (kind, namespace, name)."""
        self.calls: list[str] = []

    def list_jobs(self) -> list[dict[str, Any]]:
        self.calls.append("list_jobs")
        return copy.deepcopy(list(self.jobs.values()))

    def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        self.calls.append("get_job")
        found = self.jobs.get((namespace, name))
        return None if found is None else copy.deepcopy(found)

    def list_job_pods(self, namespace: str, job: str) -> dict[str, Any]:
        self.calls.append("list_job_pods")
        return {"items": copy.deepcopy(self.pods.get((namespace, job), [])), "metadata": {"resourceVersion": "50"}}

    def list_policies(self) -> list[dict[str, Any]]:
        self.calls.append("list_policies")
        return copy.deepcopy(self.policies)

    def read_namespace(self, name: str) -> dict[str, Any]:
        self.calls.append("read_namespace")
        return copy.deepcopy(self.namespaces.get(name) or {"metadata": {"name": name, "labels": {}}})

    def list_workloads(self, namespace: str, job: str) -> list[dict[str, Any]]:
        self.calls.append("list_workloads")
        return copy.deepcopy(self.workloads)

    def list_resource_flavors(self) -> list[dict[str, Any]]:
        self.calls.append("list_resource_flavors")
        return copy.deepcopy(self.flavors)

    def get_priority_class(self, name: str) -> dict[str, Any] | None:
        self.calls.append("get_priority_class")
        return copy.deepcopy(self.priority_classes.get(name))

    def read_stateful_set(self, namespace: str, name: str) -> dict[str, Any] | None:
        self.calls.append("read_stateful_set")
        return copy.deepcopy(self.owners.get(("StatefulSet", namespace, name)))

    def read_group_set(self, namespace: str, name: str) -> dict[str, Any] | None:
        self.calls.append("read_group_set")
        return copy.deepcopy(self.owners.get(("LeaderWorkerSet", namespace, name)))


class FakeApplierClient:
    """The writes of an Applier, recorded as ``(call, name)`` in the order they came; ``fail[(call, name)]`` is
    raised instead of that call, once; ``existing`` holds the pods a read finds; ``on_call`` runs before each call."""

    def __init__(self) -> None:
        self.writes: list[tuple[str, str]] = []
        self.fail: dict[tuple[str, str], ApiException] = {}
        self.existing: dict[str, dict[str, Any]] = {}
        self.status_patches: list[dict[str, Any]] = []
        self.revision = 200
        self.on_call = lambda call, name: None

    def _record(self, call: str, name: str) -> None:
        self.on_call(call, name)
        self.writes.append((call, name))
        if (call, name) in self.fail:
            raise self.fail.pop((call, name))

    def apply(self, child: dict[str, Any]) -> None:
        self._record("apply", f"{child['kind']} {child['metadata']['name']}")

    def delete_child(self, kind: str, namespace: str, name: str) -> None:
        self._record("delete_child", f"{kind} {name}")

    def delete_pod(self, namespace: str, name: str) -> None:
        self._record("delete_pod", name)

    def annotate_pod(self, namespace: str, name: str, values: dict[str, str]) -> None:
        self._record("annotate_pod", name)

    def patch_workload_status(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        self._record("patch_workload_status", name)

    def create_pod(self, namespace: str, pod: dict[str, Any]) -> dict[str, Any]:
        self._record("create_pod", pod["metadata"]["name"])
        self.revision += 1
        created = copy.deepcopy(pod)
        created["metadata"].update(namespace=namespace, resourceVersion=str(self.revision), uid=f"uid-{self.revision}")
        return created

    def read_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        self._record("read_pod", name)
        return copy.deepcopy(self.existing.get(name))

    def patch_job_status(self, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        self._record("patch_job_status", name)
        self.status_patches.append(patch)
        self.revision += 1
        return {
            "metadata": {"namespace": namespace, "name": name, "resourceVersion": str(self.revision)},
            "status": patch["status"],
        }

    def post_event(self, job: dict[str, Any], type_: str, reason: str, message: str) -> None:
        self._record("post_event", reason)

    def delete_job(self, namespace: str, name: str) -> None:
        self._record("delete_job", name)


def pod(job: str, name: str, revision: int, **annotations: str) -> dict[str, Any]:
    """A pod of ``job``'s, labelled as the pod watch selects it, at ``revision``."""
    return {
        "metadata": {
            "name": name,
            "namespace": "team-a",
            "uid": f"uid-{name}",
            "resourceVersion": str(revision),
            "labels": {keys.MANAGED_BY: keys.MANAGER, keys.JOB: job},
            "annotations": dict(annotations),
        },
        "status": {"phase": "Running"},
    }


class HookedLock:
    """A guard of one of the shell's parts, calling ``hook`` each time it is released: a point where another thread
    could run."""

    def __init__(self, hook: Callable[[], None]) -> None:
        self.lock = threading.Lock()
        self.hook = hook

    def __enter__(self) -> None:
        self.lock.acquire()

    def __exit__(self, *_: object) -> None:
        self.lock.release()
        self.hook()
