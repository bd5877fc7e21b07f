"""In-flight weight updates on the real control plane: the operator's barrier and the pods' agents."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from lockstep import keys
from lockstep.protocol import PROTOCOL
from lockstep_e2e.agents import running_agents
from lockstep_e2e.cluster import Component
from lockstep_e2e.fixtures import running_job, wait_for, weights_version
from lockstep_e2e.install import pod_client
from lockstep_e2e.jobs import announce_weights, condition, create_job, events_for, get_job, patch_job, phase, rljob

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("lockstep")]


@pytest.mark.parametrize(("mode", "phases"), [("Lockstep", {"Update", "Resume"}), ("Rolling", {"Resume"})])
def test_announced_weights_reach_every_actor_staged_then_swapped_in_the_pause(
    kube: client.ApiClient, namespace: str, mode: str, phases: set[str]
) -> None:
    """Lockstep: Update (stage, pause, swap) on every actor, then Resume; Rolling: one command per actor."""
    actors = running_job(kube, namespace, "sync", 3, weightSync={"mode": mode})
    with running_agents(kube, namespace, actors) as engines:
        for version in (1, 2):
            announce_weights(kube, namespace, "sync", version)
            wait_for(lambda v=version: weights_version(kube, namespace, "sync") == v, f"weights version {version}")
    for pod, engine in engines.items():
        assert engine.calls == ["stage 1", "pause", "swap 1", "resume", "stage 2", "pause", "swap 2", "resume"], pod
    status = get_job(kube, namespace, "sync")["status"]
    assert "barrier" not in status and status["lag"] == 0
    history = status["barrierHistory"]
    assert [record["version"] for record in history] == [1, 2]
    assert all(record["outcome"] == "Completed" and record["members"] == 3 for record in history)
    assert all(set(record["phaseSeconds"]) == phases for record in history)
    assert any("weights version 2 live on 3 member(s)" in e.message for e in events_for(kube, namespace, "sync"))


@pytest.mark.parametrize(
    ("phase", "step"), [("Update", "stage"), ("Update", "pause"), ("Update", "swap"), ("Resume", "resume")]
)
def test_operator_killed_in_each_phase_finishes_the_barrier_after_restart(
    kube: client.ApiClient, namespace: str, lockstep: Component, phase: str, step: str
) -> None:
    actors = running_job(kube, namespace, "crashy", 2)
    with running_agents(kube, namespace, actors) as engines:
        engines[actors[1]].gates[step].clear()  # actor 1 is slow in this phase
        announce_weights(kube, namespace, "crashy", 1)

        def in_phase() -> bool:
            barrier = get_job(kube, namespace, "crashy")["status"].get("barrier") or {}
            return barrier.get("phase") == phase

        wait_for(in_phase, f"the barrier to reach {phase}")
        assert lockstep.process is not None
        lockstep.process.kill()
        lockstep.process.wait()
        engines[actors[1]].gates[step].set()  # it acks while no operator is running
        lockstep.start()
        wait_for(lambda: weights_version(kube, namespace, "crashy") == 1, "the restarted operator to finish it")
    for engine in engines.values():
        assert engine.calls == ["stage 1", "pause", "swap 1", "resume"]
    # Lag is recomputed on every pass from the running actors; wait for a pass that sees them both.
    wait_for(lambda: get_job(kube, namespace, "crashy")["status"].get("lag") == 0, "lag 0 after the restart")


def test_actor_deleted_mid_barrier_leaves_it_and_its_replacement_catches_up(
    kube: client.ApiClient, namespace: str
) -> None:
    actors = running_job(kube, namespace, "shrink", 2)
    core = client.CoreV1Api(kube)
    lost = core.read_namespaced_pod(actors[1], namespace).metadata.uid
    with running_agents(kube, namespace, actors[:1]):
        announce_weights(kube, namespace, "shrink", 1)
        wait_for(lambda: get_job(kube, namespace, "shrink")["status"].get("barrier"), "the barrier to open")
        core.delete_namespaced_pod(actors[1], namespace)  # it never acked; now it is gone
        wait_for(lambda: weights_version(kube, namespace, "shrink") == 1, "the barrier to finish without it")
        replacement_catches_up(kube, namespace, "shrink", actors[1], lost)


KILLED = {
    "status": {
        "phase": "Failed",
        "containerStatuses": [{"name": keys.ACTOR, "state": {"terminated": {"exitCode": 137, "reason": "Error"}}}],
    }
}
"""What the kubelet reports of an actor pod whose process was killed by SIGKILL (restartPolicy Never)."""


@pytest.mark.parametrize("step", ["stage", "swap"])
def test_an_actor_killed_while_it_stages_or_swaps_is_replaced_on_the_newest_weights(
    kube: client.ApiClient, namespace: str, step: str
) -> None:
    """kill -9 of an actor's process mid-step (its agent stops there and never acks; restartPolicy Never, so the
    kubelet reports the pod Failed): the barrier finishes without it, the other member resumes, and the pod's
    replacement comes to the newest weights."""
    actors = running_job(kube, namespace, "killed", 2)
    core = client.CoreV1Api(kube)
    lost = core.read_namespaced_pod(actors[1], namespace).metadata.uid
    with running_agents(kube, namespace, actors) as engines:
        victim = engines[actors[1]]
        victim.gates[step].clear()
        announce_weights(kube, namespace, "killed", 1)
        wait_for(lambda: victim.waiting == step, f"{actors[1]} to {step} version 1")
        victim.kill()
        core.patch_namespaced_pod_status(actors[1], namespace, KILLED)
        wait_for(lambda: weights_version(kube, namespace, "killed") == 1, "the barrier to finish without it")
        assert engines[actors[0]].calls == ["stage 1", "pause", "swap 1", "resume"], "the other member resumed"
        assert victim.calls == ([] if step == "stage" else ["stage 1", "pause"])
        replacement_catches_up(kube, namespace, "killed", actors[1], lost)
    assert get_job(kube, namespace, "killed")["status"]["restarts"] == 1, "the kill counts against maxRestarts"


def replacement_catches_up(kube: client.ApiClient, namespace: str, job: str, pod: str, lost: str) -> None:
    """Once barrier 1 finished without ``pod`` (pod UID ``lost``), its replacement comes to version 1, and no
    barrier stays open."""
    core = client.CoreV1Api(kube)

    def replaced() -> bool:
        pods = core.list_namespaced_pod(namespace, field_selector=f"metadata.name={pod}").items
        return bool(pods) and pods[0].metadata.uid != lost and pods[0].status.phase == "Running"

    wait_for(replaced, f"{pod} to be recreated", timeout=90)
    # Recreated after the barrier closed, it starts from the committed weights; recreated while it was still open
    # (nothing committed yet), it catches up in a barrier of its own.
    initial = core.read_namespaced_pod(pod, namespace).metadata.annotations.get(keys.INITIAL_WEIGHTS)
    expected = ["stage 1", "swap 1"] if initial else ["stage 1", "pause", "swap 1", "resume"]
    with running_agents(kube, namespace, [pod]) as late:
        wait_for(lambda: late[pod].calls == expected, f"the replacement to reach version 1 by {expected}")
        wait_for(lambda: "barrier" not in get_job(kube, namespace, job)["status"], "no barrier open")
    history = get_job(kube, namespace, job)["status"]["barrierHistory"]
    barriers = [(1, 1)] if initial else [(1, 1), (1, 1)]  # (version, members): the update, then the catch-up
    assert [(r["version"], r["members"]) for r in history] == barriers


def test_a_silent_actor_fails_the_job_on_timeout(kube: client.ApiClient, namespace: str) -> None:
    body = rljob("stuck", actors=2, weightSync={"barrierTimeoutSeconds": 3, "onTimeout": "FailJob"})
    create_job(kube, namespace, body)
    wait_for(lambda: phase(get_job(kube, namespace, "stuck")) == "Running", "RLJob stuck to run")
    with running_agents(kube, namespace, ["stuck-actor-0"]):  # stuck-actor-1 never answers
        announce_weights(kube, namespace, "stuck", 1)
        wait_for(lambda: phase(get_job(kube, namespace, "stuck")) == "Failed", "the job to fail", timeout=60)
    ready = next(c for c in get_job(kube, namespace, "stuck")["status"]["conditions"] if c["type"] == "Ready")
    assert ready["reason"] == "WeightUpdateFailed"
    assert "stuck-actor-1 did not ack Update in time (spec.weightSync.onTimeout: FailJob)" in ready["message"]


def test_a_silent_actor_is_evicted_and_the_update_goes_on(kube: client.ApiClient, namespace: str) -> None:
    body = rljob("evict", actors=2, weightSync={"barrierTimeoutSeconds": 3, "onTimeout": "EvictStraggler"})
    create_job(kube, namespace, body)
    wait_for(lambda: phase(get_job(kube, namespace, "evict")) == "Running", "RLJob evict to run")
    with running_agents(kube, namespace, ["evict-actor-0"]) as engines:
        announce_weights(kube, namespace, "evict", 1)
        wait_for(lambda: weights_version(kube, namespace, "evict") == 1, "the update without the straggler", 60)
    assert engines["evict-actor-0"].calls == ["stage 1", "pause", "swap 1", "resume"]
    record = get_job(kube, namespace, "evict")["status"]["barrierHistory"][-1]
    assert record["evicted"] == ["evict-actor-1"] and record["outcome"] == "Completed"
    assert any("evicted from barrier" in e.message for e in events_for(kube, namespace, "evict"))


def test_weights_the_actors_memory_limit_cannot_stage_wait_with_a_condition_until_it_is_raised(
    kube: client.ApiClient, namespace: str
) -> None:
    body = rljob("roomy", actors=1)
    body["spec"]["actors"]["resources"] = {"limits": {"memory": "1Gi"}}
    create_job(kube, namespace, body)
    wait_for(lambda: phase(get_job(kube, namespace, "roomy")) == "Running", "RLJob roomy to run")
    announce_weights(kube, namespace, "roomy", 1, size=10**9)
    wait_for(
        lambda: condition(get_job(kube, namespace, "roomy"), "WeightsFitMemory").get("status") == "False",
        "WeightsFitMemory=False",
    )
    status = get_job(kube, namespace, "roomy")["status"]
    fit = condition({"status": status}, "WeightsFitMemory")
    assert fit["reason"] == "ActorMemoryLimitTooLow"
    assert fit["message"].startswith(
        "actor memory limit 1Gi cannot hold weights version 1 (0.93 GiB) twice: staging needs the model and one "
        "staged copy in host memory, at least 1.87 GiB; raise spec.actors.resources.limits.memory"
    )
    assert "barrier" not in status and not status.get("barrierHistory"), "no barrier opened"

    def warned() -> list[client.CoreV1Event]:
        return [e for e in events_for(kube, namespace, "roomy") if e.reason == "ActorMemoryLimitTooLow"]

    wait_for(warned, "a Warning Event")  # written after the status
    assert [(e.type, e.count) for e in warned()] == [("Warning", 1)] and fit["message"] in warned()[0].message

    old_uid = client.CoreV1Api(kube).read_namespaced_pod("roomy-actor-0", namespace).metadata.uid
    patch_job(kube, namespace, "roomy", {"spec": {"actors": {"resources": {"limits": {"memory": "2Gi"}}}}})

    def replaced() -> bool:
        pods = client.CoreV1Api(kube).list_namespaced_pod(namespace, field_selector="metadata.name=roomy-actor-0")
        return any(p.metadata.uid != old_uid and p.status.phase == "Running" for p in pods.items)

    wait_for(replaced, "the actor to be replaced with the raised limit", timeout=90)
    with running_agents(kube, namespace, ["roomy-actor-0"]):
        wait_for(lambda: weights_version(kube, namespace, "roomy") == 1, "the announced version, once it fits")
    assert condition(get_job(kube, namespace, "roomy"), "WeightsFitMemory")["reason"] == "WithinMemoryLimit"


def test_unreadable_and_stale_acks_are_ignored(kube: client.ApiClient, namespace: str) -> None:
    actors = running_job(kube, namespace, "noisy", 1)
    core = client.CoreV1Api(pod_client(kube, namespace, actors[0]))
    announce_weights(kube, namespace, "noisy", 1)
    wait_for(lambda: get_job(kube, namespace, "noisy")["status"].get("barrier"), "the barrier to open")
    core.patch_namespaced_pod(actors[0], namespace, {"metadata": {"annotations": {keys.BARRIER_ACK: "{not json"}}})
    wait_for(
        lambda: any("ignored the ack on noisy-actor-0" in e.message for e in events_for(kube, namespace, "noisy")),
        "an Event about the unreadable ack",
    )
    stale = json.dumps({"protocol": PROTOCOL, "id": "someone-else/1/1", "phase": "Updated"})
    core.patch_namespaced_pod(actors[0], namespace, {"metadata": {"annotations": {keys.BARRIER_ACK: stale}}})
    time.sleep(1)  # give the operator a pass over the stale ack
    assert get_job(kube, namespace, "noisy")["status"]["barrier"]["phase"] == "Update"
    with running_agents(kube, namespace, actors):
        wait_for(lambda: weights_version(kube, namespace, "noisy") == 1, "the update once the agent answers")


def forbidden(call: Any) -> str:
    with pytest.raises(ApiException) as refused:
        call()
    assert refused.value.status in (403, 422), refused.value.body
    return str(json.loads(refused.value.body)["message"])


def test_only_the_operator_commands_and_a_pod_acks_only_for_itself(kube: client.ApiClient, namespace: str) -> None:
    actors = running_job(kube, namespace, "guarded", 2)
    running_job(kube, namespace, "other", 1)
    as_actor0 = client.CoreV1Api(pod_client(kube, namespace, actors[0]))
    as_admin = client.CoreV1Api(kube)
    as_other_job = client.CoreV1Api(pod_client(kube, namespace, "other-actor-0"))
    worker = f"system:serviceaccount:{namespace}:guarded-worker"
    command = json.dumps(
        {"protocol": PROTOCOL, "id": "forged/1/1", "version": 1, "uri": "u", "digest": "d", "phase": "Pause"}
    )
    ack = json.dumps({"protocol": PROTOCOL, "id": "forged/1/1", "phase": "Paused"})

    def annotate(api: client.CoreV1Api, pod: str, key: str, value: str) -> Any:
        return lambda: api.patch_namespaced_pod(pod, namespace, {"metadata": {"annotations": {key: value}}})

    message = forbidden(annotate(as_actor0, actors[0], keys.BARRIER, command))
    assert f"lockstep.dev/barrier may be written only by the Lockstep operator ({keys.OPERATOR_USERNAME}), " in message
    assert f"not by {worker}" in message
    assert "may be written only by the Lockstep operator" in forbidden(
        annotate(as_admin, actors[0], keys.BARRIER, command)
    )

    message = forbidden(annotate(as_actor0, actors[1], keys.BARRIER_ACK, ack))
    assert (
        f"lockstep.dev/barrier-ack on pod {actors[1]} may be written only by that pod itself (a service-account token "
        f"bound to it), not by {worker} for pod {actors[0]}"
    ) in message
    assert "may be written only by that pod itself" in forbidden(annotate(as_admin, actors[1], keys.BARRIER_ACK, ack))
    # Another job's pods may not even read or patch this job's pods (RBAC, before admission).
    assert "forbidden" in forbidden(annotate(as_other_job, actors[0], keys.BARRIER_ACK, ack))

    annotate(as_actor0, actors[0], keys.BARRIER_ACK, ack)()  # its own ack: allowed
    assert as_admin.read_namespaced_pod(actors[0], namespace).metadata.annotations[keys.BARRIER_ACK] == ack
