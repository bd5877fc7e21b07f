"""Small helpers to create and read RLJobs in end-to-end tests, benchmarks and the demo."""

from __future__ import annotations

import json
from typing import Any, cast

from kubernetes import client

from lockstep import api, keys
from lockstep.protocol import PROTOCOL
from lockstep_e2e.install import pod_client

POLICIES = (api.GROUP, api.VERSION, api.PARITY_POLICIES)
REWARD = "lockstep_workers.rewards:target_words"
SHARED_VOLUME = {"hostPath": {"path": "/var/lib/lockstep", "type": "DirectoryOrCreate"}}


def rljob(
    name: str,
    *,
    actors: int = 2,
    trainers: int = 1,
    vllm: dict[str, Any] | None = None,
    trainer: dict[str, Any] | None = None,
    actor_env: list[dict[str, Any]] | None = None,
    **spec: Any,
) -> dict[str, Any]:
    """A valid RLJob manifest; ``vllm`` sets spec.actors.vllm, ``trainer`` further spec.trainer fields,
    ``actor_env`` spec.actors.env, other keyword arguments top-level spec fields (``weightSync`` fields are
    added to the default shared volume, which a collective backend goes without)."""
    weight_sync = spec.pop("weightSync", {})
    if weight_sync.get("backend", "filesystem") == "filesystem":
        weight_sync = {"volume": SHARED_VOLUME, **weight_sync}
    actor = {"image": "lockstep/actor:dev", "replicas": actors, "vllm": vllm or {}}
    if actor_env:
        actor["env"] = actor_env
    return {
        "apiVersion": api.API_VERSION,
        "kind": "RLJob",
        "metadata": {"name": name},
        "spec": {
            "model": {"uri": "/models/tiny-llama", "dtype": "float32"},
            "actors": actor,
            "trainer": {"image": "lockstep/trainer:dev", "replicas": trainers, "reward": REWARD, **(trainer or {})},
            "weightSync": weight_sync,
            **spec,
        },
    }


def create_job(kube: client.ApiClient, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
    return cast(
        dict[str, Any],
        client.CustomObjectsApi(kube).create_namespaced_custom_object(
            api.GROUP, api.VERSION, namespace, api.RLJOBS, body
        ),
    )


def get_job(kube: client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    return cast(
        dict[str, Any],
        client.CustomObjectsApi(kube).get_namespaced_custom_object(api.GROUP, api.VERSION, namespace, api.RLJOBS, name),
    )


def patch_job(kube: client.ApiClient, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
    return cast(
        dict[str, Any],
        client.CustomObjectsApi(kube).patch_namespaced_custom_object(
            api.GROUP, api.VERSION, namespace, api.RLJOBS, name, patch
        ),
    )


def condition(job: dict[str, Any], type_: str) -> dict[str, Any]:
    """The condition of that type, or {} (never by list position)."""
    conditions = (job.get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == type_), {})


def phase(job: dict[str, Any]) -> str | None:
    value = (job.get("status") or {}).get("phase")
    return None if value is None else str(value)


def job_pods(kube: client.ApiClient, namespace: str, name: str) -> list[client.V1Pod]:
    pods: list[client.V1Pod] = (
        client.CoreV1Api(kube).list_namespaced_pod(namespace, label_selector=f"lockstep.dev/job={name}").items
    )
    return sorted(pods, key=lambda p: str(p.metadata.name))


def events_for(kube: client.ApiClient, namespace: str, name: str) -> list[client.CoreV1Event]:
    events: list[client.CoreV1Event] = (
        client.CoreV1Api(kube)
        .list_namespaced_event(namespace, field_selector=f"involvedObject.kind=RLJob,involvedObject.name={name}")
        .items
    )
    return events


def announce_weights(kube: client.ApiClient, namespace: str, job: str, version: int, size: int | None = None) -> None:
    """What the trainer does after publishing weights: annotate its own pod (with a token bound to it), naming a
    file in the job's directory on its weights volume (and, with ``size``, the version's size in bytes)."""
    uri = f"file:///var/lib/lockstep/{get_job(kube, namespace, job)['metadata']['uid']}/weights/v{version}.safetensors"
    weights: dict[str, Any] = {"protocol": PROTOCOL, "version": version, "uri": uri, "digest": f"sha256:{version}"}
    if size is not None:
        weights["bytes"] = size
    trainer = f"{job}-trainer-0"
    client.CoreV1Api(pod_client(kube, namespace, trainer)).patch_namespaced_pod(
        trainer, namespace, {"metadata": {"annotations": {keys.WEIGHTS: json.dumps(weights)}}}
    )
