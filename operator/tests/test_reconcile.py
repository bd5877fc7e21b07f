"""The reconciler as a whole (lockstep.reconcile): properties over many situations. Each step's own
situations are in test_reconcile_<step>.py; Kueue's (the queue step) in test_kueue_workload.py."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from factories import REWARD, job, running
from lockstep import keys
from lockstep.api import Phase
from lockstep.conditions import READY, find
from reconcile_helpers import condition, plan_for

pod_states = st.sampled_from(["absent", "pending", "running", "failed", "succeeded", "drifted", "deleting"])


@settings(max_examples=300)
@given(
    actors=st.integers(1, 4),
    trainers=st.integers(1, 3),
    states=st.lists(pod_states, min_size=7, max_size=7),
    was_running=st.booleans(),
    suspend=st.booleans(),
)
def test_plans_are_consistent_whatever_the_pods_look_like(
    actors: int, trainers: int, states: list[str], was_running: bool, suspend: bool
) -> None:
    body = job(
        actors={"image": "a", "replicas": actors},
        trainer={"image": "t", "reward": REWARD, "replicas": trainers},
        suspend=suspend,
        maxRestarts=2,
    )
    trainer = {"image": "t", "reward": REWARD, "replicas": 3}
    template = plan_for(job(actors={"image": "a", "replicas": 4}, trainer=trainer))
    pods = []
    for pod, state in zip(template.create_pods, states, strict=True):
        if state == "absent":
            continue
        phase = {"pending": "Pending", "failed": "Failed", "succeeded": "Succeeded"}.get(state, "Running")
        observed = running(pod, phase=phase, ready=phase == "Running")
        if state == "drifted":
            observed["metadata"]["annotations"] = {**pod["metadata"]["annotations"], keys.CONFIG_FINGERPRINT: "x"}
        if state == "deleting":
            observed["metadata"] = {**pod["metadata"], "deletionTimestamp": "2026-11-29T11:00:00Z"}
        pods.append(observed)
    if was_running:
        body["status"] = {"phase": "Running", "actors": {"desired": actors}, "trainer": {"desired": trainers}}
    plan = plan_for(body, pods)

    live = {p["metadata"]["name"] for p in pods if "deletionTimestamp" not in p["metadata"]}
    created = [p["metadata"]["name"] for p in plan.create_pods]
    assert not set(created) & live, "never create a pod that exists"
    assert not set(created) & set(plan.delete_pods), "never create and delete the same pod"
    assert set(plan.delete_pods) <= live, "only delete pods that exist"
    assert plan.status.actors.ready <= plan.status.actors.desired
    assert plan.status.trainer.ready <= plan.status.trainer.desired
    if suspend or plan.status.phase in (Phase.SUCCEEDED, Phase.FAILED):
        assert not created and set(plan.delete_pods) == live
    if plan.status.phase is Phase.RUNNING and not (plan.delete_pods or created or plan.requeue_after):
        assert condition(plan, READY) == ("True", "AllPodsReady")
    ready = find(plan.status.conditions, READY)
    assert ready is not None and ready.message, "every outcome explains itself"
