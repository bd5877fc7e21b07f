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
