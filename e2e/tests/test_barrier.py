"""In-flight weight updates on the real control plane: the operator's barrier and the pods' agents."""

from __future__ import annotations

import json

import pytest
from kubernetes import client

from lockstep import keys
from lockstep_e2e.agents import running_agents
from lockstep_e2e.cluster import Component
from lockstep_e2e.fixtures import wait_for
from lockstep_e2e.jobs import create_job, events_for, get_job, phase, rljob

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("lockstep")]


def announce(kube: client.ApiClient, namespace: str, job: str, version: int) -> None:
    """What the trainer does after publishing weights: annotate its own pod."""
    weights = {"protocol": 1, "version": version, "uri": f"file:///weights/v{version}", "digest": f"sha256:{version}"}
    client.CoreV1Api(kube).patch_namespaced_pod(
        f"{job}-trainer-0", namespace, {"metadata": {"annotations": {keys.WEIGHTS: json.dumps(weights)}}}
    )


def running(kube: client.ApiClient, namespace: str, name: str, actors: int) -> list[str]:
    create_job(kube, namespace, rljob(name, actors=actors))
    wait_for(lambda: phase(get_job(kube, namespace, name)) == "Running", f"RLJob {name} to run")
    return [f"{name}-actor-{i}" for i in range(actors)]


def weights_version(kube: client.ApiClient, namespace: str, name: str) -> int | None:
    return get_job(kube, namespace, name)["status"].get("weightsVersion")


def test_announced_weights_reach_every_actor_through_pause_update_resume(
    kube: client.ApiClient, namespace: str
) -> None:
    actors = running(kube, namespace, "sync", 3)
    with running_agents(kube, namespace, actors) as engines:
        for version in (1, 2):
            announce(kube, namespace, "sync", version)
            wait_for(lambda v=version: weights_version(kube, namespace, "sync") == v, f"weights version {version}")
    for pod, engine in engines.items():
        assert engine.calls == ["pause", "load 1", "resume", "pause", "load 2", "resume"], pod
    status = get_job(kube, namespace, "sync")["status"]
    assert "barrier" not in status and status["lag"] == 0
    history = status["barrierHistory"]
    assert [record["version"] for record in history] == [1, 2]
    assert all(record["outcome"] == "Completed" and record["members"] == 3 for record in history)
    assert set(history[0]["phaseSeconds"]) == {"Pause", "Update", "Resume"}
    assert any("weights version 2 live on 3 member(s)" in e.message for e in events_for(kube, namespace, "sync"))


def test_operator_killed_mid_barrier_resumes_it_after_restart(
    kube: client.ApiClient, namespace: str, lockstep: Component
) -> None:
    actors = running(kube, namespace, "crashy", 2)
    with running_agents(kube, namespace, actors) as engines:
        engines[actors[1]].hold.clear()  # actor 1 is slow to load
        announce(kube, namespace, "crashy", 1)

        def in_update() -> bool:
            barrier = get_job(kube, namespace, "crashy")["status"].get("barrier") or {}
            return barrier.get("phase") == "Update"

        wait_for(in_update, "the barrier to reach Update")
        assert lockstep.process is not None
        lockstep.process.kill()
        lockstep.process.wait()
        engines[actors[1]].hold.set()
        lockstep.start()
        wait_for(lambda: weights_version(kube, namespace, "crashy") == 1, "the restarted operator to finish it")
    for engine in engines.values():
        assert engine.calls == ["pause", "load 1", "resume"]
