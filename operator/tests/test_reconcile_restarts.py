"""The restarts step (lockstep.reconcile.restarts): failures, counted against spec.maxRestarts."""

from __future__ import annotations

import datetime as dt
from typing import Any

from factories import NOW, REWARD, job, running
from lockstep import protocol
from lockstep.api import Phase
from lockstep.conditions import READY, find
from lockstep.reconcile import restart_backoff_seconds
from reconcile_helpers import condition, plan_for, settle, status_of


def test_failed_pod_is_restarted_after_backoff_then_the_job_fails_past_max_restarts() -> None:
    body, pods = settle(job(maxRestarts=1))
    pods[1] = running(pods[1], phase="Failed", ready=False)
    lost = plan_for(body, pods)
    assert lost.status.restarts == 1 and condition(lost, READY) == ("False", "Restarting")
    assert lost.delete_pods == {"demo-actor-1": "it failed"}
    assert not lost.create_pods and lost.requeue_after == restart_backoff_seconds(1)

    body = {**body, "status": status_of(lost)}
    survivors = [p for p in pods if p["metadata"]["name"] != "demo-actor-1"]
    early = plan_for(body, survivors, now=NOW + dt.timedelta(seconds=3))
    assert not early.create_pods and early.status.restarts == 1
    later = plan_for(body, survivors, now=NOW + dt.timedelta(seconds=11))
    assert [p["metadata"]["name"] for p in later.create_pods] == ["demo-actor-1"]

    body = {**body, "status": status_of(later)}
    back = [*survivors, running(later.create_pods[0])]
    healthy = plan_for(body, back, now=NOW + dt.timedelta(seconds=12))
    assert condition(healthy, READY) == ("True", "AllPodsReady")

    body = {**body, "status": status_of(healthy)}
    gone = plan_for(body, back[1:], now=NOW + dt.timedelta(seconds=20))
    assert gone.status.phase is Phase.FAILED
    assert condition(gone, READY) == ("False", "RestartLimitExceeded")
    assert set(gone.delete_pods) == {p["metadata"]["name"] for p in back[1:]}


def test_a_loss_during_a_restart_joins_it_and_the_restart_is_kept_in_the_status_not_in_a_reason() -> None:
    body, pods = settle(job(maxRestarts=3))
    first = plan_for(body, [running(pods[0], phase="Failed", ready=False), *pods[1:]])
    assert first.status.restarts == 1 and first.status.restarting == ["demo-actor-0"]

    body = {**body, "status": status_of(first)}
    second = plan_for(body, [running(pods[1], phase="Failed", ready=False), pods[2]], now=NOW + dt.timedelta(seconds=1))
    assert second.status.restarts == 1, "a loss while a restart is under way joins it"
    assert second.status.restarting == ["demo-actor-0", "demo-actor-1"]
    assert second.delete_pods == {"demo-actor-1": "it failed"}

    # What the pass remembers is status.restarting, whatever Ready's reason says.
    body = {**body, "status": status_of(second)}
    recreated = plan_for(body, [pods[2]], now=NOW + dt.timedelta(seconds=11))
    assert sorted(p["metadata"]["name"] for p in recreated.create_pods) == ["demo-actor-0", "demo-actor-1"]
    body = {**body, "status": status_of(recreated)}
    back = [running(p) for p in recreated.create_pods] + [pods[2]]
    healthy = plan_for(body, back, now=NOW + dt.timedelta(seconds=12))
    assert healthy.status.restarting == [] and condition(healthy, READY) == ("True", "AllPodsReady")
    restarting_reason = {**body, "status": {**status_of(healthy), "conditions": status_of(second)["conditions"]}}
    again = plan_for(restarting_reason, back[1:], now=NOW + dt.timedelta(seconds=13))
    assert again.status.restarts == 2, "a new loss after the pods came back is a new restart"


def test_a_lost_trainer_rank_restarts_every_rank_and_no_actor() -> None:
    body, pods = settle(job(trainer={"image": "t", "reward": REWARD, "replicas": 2}))
    pods[3] = running(pods[3], phase="Failed", ready=False)  # demo-trainer-1
    plan = plan_for(body, pods)
    assert set(plan.delete_pods) == {"demo-trainer-0", "demo-trainer-1"}
    assert "the ranks restart together" in plan.delete_pods["demo-trainer-0"]
    assert plan.status.restarts == 1


GAVE_UP = "NonFiniteGradients: 5 optimiser steps in a row had gradient norm nan; each was skipped, no weight changed"


def gave_up(pods: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    """``pods`` with pod ``name`` failed with the trainer's exit code for a failure no restart can help."""
    exited = {"exitCode": protocol.TRAINER_GAVE_UP_EXIT_CODE, "message": f"{GAVE_UP}\n"}
    failed = [running(p, phase="Failed", ready=False) if p["metadata"]["name"] == name else p for p in pods]
    for pod in failed:
        if pod["metadata"]["name"] == name:
            pod["status"]["containerStatuses"] = [{"name": "c", "state": {"terminated": exited}}]
    return failed


def test_a_trainer_that_gave_up_fails_the_job_at_once_quoting_why() -> None:
    """Its gradients stayed non-finite: a restart would resume from the same weights, so no restart is spent."""
    body, pods = settle(job(maxRestarts=3))
    stopped = plan_for(body, gave_up(pods, "demo-trainer-0"))
    assert stopped.status.phase is Phase.FAILED and stopped.status.restarts == 0
    ready = find(stopped.status.conditions, READY)
    assert ready is not None and ready.reason == "TrainerGaveUp"
    assert f"trainer pod demo-trainer-0 stopped for good ({GAVE_UP})" in ready.message
    restarted = plan_for(body, gave_up(pods, "demo-actor-0"))
    assert restarted.status.phase is not Phase.FAILED and restarted.status.restarts == 1, "only the trainer's code"
    both = plan_for(body, gave_up(gave_up(pods, "demo-actor-0"), "demo-trainer-0"))
    assert both.status.phase is Phase.FAILED and both.status.restarts == 0, "an actor failing first hides nothing"


def test_a_trainer_that_stops_on_its_dataset_says_why_in_the_ready_condition() -> None:
    body, pods = settle(job(maxRestarts=0))
    trainer = next(n for n, p in enumerate(pods) if p["metadata"]["name"] == "demo-trainer-0")
    assert pods[trainer]["spec"]["containers"][0]["terminationMessagePolicy"] == "FallbackToLogsOnError"
    refused = "spec.trainer.dataset: /data/train.jsonl: no field 'answer' (spec.trainer.dataset.rewardFields)"
    failed = running(pods[trainer], phase="Failed", ready=False)
    failed["status"]["containerStatuses"] = [
        {"name": "trainer", "state": {"terminated": {"exitCode": 1, "message": f"Traceback ...\n{refused}\n"}}}
    ]
    pods[trainer] = failed
    stopped = plan_for(body, pods)
    assert stopped.status.phase is Phase.FAILED
    ready = find(stopped.status.conditions, READY)
    assert ready is not None and ready.reason == "RestartLimitExceeded"
    assert f"pod(s) demo-trainer-0 failed or were deleted (demo-trainer-0: {refused})" in ready.message
