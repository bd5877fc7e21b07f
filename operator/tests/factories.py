"""Builders of raw API objects for the operator's unit tests."""

from __future__ import annotations

import datetime as dt
from typing import Any

from lockstep.parity import default_policy

NOW = dt.datetime(2026, 11, 29, 12, 0, 0, tzinfo=dt.UTC)
REWARD = "lockstep_workers.rewards:target_words"
SHARED_VOLUME = {"hostPath": {"path": "/var/lib/lockstep", "type": "DirectoryOrCreate"}}


def evaluate(expression: str, **activation: Any) -> Any:
    """A CEL expression of the CRDs or admission policies, evaluated offline with ``activation`` (JSON values)."""
    from celpy.adapter import json_to_cel

    from lockstep.cli import _cel_program

    return _cel_program(expression).evaluate({name: json_to_cel(value) for name, value in activation.items()})


def job(name: str = "demo", *, status: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "apiVersion": "lockstep.dev/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": name, "namespace": "team-a", "uid": "uid-1", "generation": 1},
        "spec": {
            "model": {"uri": "/models/tiny"},
            "actors": {"image": "lockstep/actor:dev", "replicas": 2},
            "trainer": {"image": "lockstep/trainer:dev", "replicas": 1, "reward": REWARD},
            "weightSync": {"volume": SHARED_VOLUME},
            **spec,
        },
    }
    if status is not None:
        body["status"] = status
    return body


def policy(name: str = "default", **spec: Any) -> dict[str, Any]:
    body = default_policy().model_dump(mode="json", by_alias=True)
    body["metadata"] = {"name": name}
    body["spec"].update(spec)
    return body


def running(pod: dict[str, Any], phase: str = "Running", ready: bool = True) -> dict[str, Any]:
    """The pod as the API server returns it once kwok ran it."""
    return {
        **pod,
        "metadata": {**pod["metadata"], "uid": f"uid-{pod['metadata']['name']}"},
        "status": {"phase": phase, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def owner_reference(kind: str, name: str, uid: str, api_version: str, controller: bool = True) -> dict[str, Any]:
    return {"apiVersion": api_version, "kind": kind, "name": name, "uid": uid, "controller": controller}


def owned(obj: dict[str, Any], *references: dict[str, Any]) -> dict[str, Any]:
    """``obj`` with exactly these owner references."""
    return {**obj, "metadata": {**obj["metadata"], "ownerReferences": list(references)}}


def stateful_set(name: str, uid: str, *references: dict[str, Any]) -> dict[str, Any]:
    """A StatefulSet as the pods' owner chain reads it (kind and metadata)."""
    return {"kind": "StatefulSet", "metadata": {"name": name, "uid": uid, "ownerReferences": list(references)}}


def group_set_owners(body: dict[str, Any], pods: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The group pods ``pods`` (desired.group_pods, running) as LeaderWorkerSet v0.9 owns them, and their owners by
    UID: each leader by the StatefulSet <job>-actor that the job's LeaderWorkerSet controls (its controller the
    RLJob), each worker by the StatefulSet named after its leader, which that leader pod controls."""
    name, uid = body["metadata"]["name"], body["metadata"]["uid"]
    lws = {
        "kind": "LeaderWorkerSet",
        "metadata": {
            "name": f"{name}-actor",
            "uid": "uid-lws",
            "ownerReferences": [owner_reference("RLJob", name, uid, "lockstep.dev/v1alpha1")],
        },
    }
    leaders = stateful_set(
        f"{name}-actor",
        "uid-sts",
        owner_reference("LeaderWorkerSet", f"{name}-actor", "uid-lws", "leaderworkerset.x-k8s.io/v1"),
    )
    owners = {"uid-lws": lws, "uid-sts": leaders}
    by_name = {pod["metadata"]["name"]: pod for pod in pods}
    result = []
    for pod in pods:
        pod_name = pod["metadata"]["name"]
        if pod["metadata"]["labels"]["lockstep.dev/role"] != "actor-worker":
            result.append(owned(pod, owner_reference("StatefulSet", f"{name}-actor", "uid-sts", "apps/v1")))
            continue
        leader = pod_name.rsplit("-", 1)[0]
        workers_uid = f"uid-sts-{leader}"
        leader_uid = by_name[leader]["metadata"]["uid"]
        owners[workers_uid] = stateful_set(leader, workers_uid, owner_reference("Pod", leader, leader_uid, "v1"))
        result.append(owned(pod, owner_reference("StatefulSet", leader, workers_uid, "apps/v1")))
    return result, owners
