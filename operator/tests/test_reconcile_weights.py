"""The weights step (lockstep.reconcile.weights): the weight-update barrier and the final update."""

from __future__ import annotations

import datetime as dt
import json

from factories import NOW, job, running
from lockstep import keys
from lockstep.api import Phase
from lockstep.conditions import PARITY_LOCKED, READY, WEIGHTS_FIT_MEMORY, find
from lockstep.events import slim
from reconcile_helpers import announce, carry_barrier, condition, pass_after, plan_for, settle, status_of


def test_announced_weights_run_a_barrier_to_the_new_version() -> None:
    body, pods = settle(job())
    announce(pods[2], 3)
    body, now = carry_barrier(body, pods, 3)
    done = plan_for(body, pods, now=now)
    assert done.status.barrier is None and done.status.weights_version == 3 and done.status.lag == 0
    assert [r.version for r in done.status.barrier_history] == [3]
    assert any(e.reason == "WeightUpdate" and "version 3 live on 2 member(s)" in e.message for e in done.events)

    body = {**body, "status": status_of(done)}
    grown = plan_for({**body, "spec": {**body["spec"], "actors": {"image": "lockstep/actor:dev", "replicas": 3}}}, pods)
    created = grown.create_pods[0]["metadata"]["annotations"][keys.INITIAL_WEIGHTS]
    assert json.loads(created)["version"] == 3, "a new pod starts from the committed weights"


def test_with_a_collective_backend_the_trainer_sends_and_new_actors_wait_for_a_catch_up_barrier() -> None:
    body, pods = settle(job(weightSync={"backend": "gloo"}))
    trainer = pods[2]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in trainer["env"]}
    assert env["LOCKSTEP_WEIGHT_SYNC"] == "gloo" and env["LOCKSTEP_WEIGHTS_HOST"] == env["MASTER_ADDR"]
    assert {p["name"] for p in trainer["ports"]} >= {"weights", "weights-group"}
    assert {"emptyDir": {}} in [{k: v for k, v in vol.items() if k != "name"} for vol in pods[2]["spec"]["volumes"]]
    assert "LOCKSTEP_SHARED_DIR" not in {e["name"] for e in pods[0]["spec"]["containers"][0]["env"]}, (
        "actors mount no weights volume: the trainer sends"
    )
    announce(pods[2], 3)
    plan = plan_for(body, pods)
    assert set(plan.annotate_pods) == {"demo-actor-0", "demo-actor-1", "demo-trainer-0"}
    body, now = carry_barrier(body, pods, 3, members=3)
    done = plan_for(body, pods, now=now)
    assert done.status.weights_version == 3 and done.status.barrier is None

    body = {**body, "status": status_of(done)}
    grown_spec = {**body["spec"], "actors": {"image": "lockstep/actor:dev", "replicas": 3}}
    new_pod = running(plan_for({**body, "spec": grown_spec}, pods).create_pods[0])
    catch_up = plan_for({**body, "spec": grown_spec}, [*pods, new_pod], now=now)
    assert catch_up.status.barrier is not None and catch_up.status.barrier.version == 3
    assert set(catch_up.annotate_pods) == {"demo-actor-2", "demo-trainer-0"}, (
        "a new actor cannot load the committed weights alone: the trainer sends them in a catch-up barrier"
    )


def test_a_straggler_evicted_by_policy_is_a_replacement() -> None:
    body, pods = settle(job(weightSync={"volume": {"emptyDir": {}}, "onTimeout": "EvictStraggler"}))
    announce(pods[2], 1)
    opened = plan_for(body, pods)
    body = {**body, "status": status_of(opened)}
    late = plan_for(body, pods, now=NOW + dt.timedelta(seconds=601))
    assert set(late.delete_pods) == {"demo-actor-0", "demo-actor-1"}
    assert late.status.replacements == 2 and late.status.restarts == 0
    assert late.status.barrier is None and late.status.weights_version is None, "no member loaded version 1"
    after, _ = pass_after(late, body, pods)
    assert after.status.restarts == 0 and len(after.create_pods) == 2


def test_an_open_barrier_ends_by_its_deadline_while_no_policy_resolves() -> None:
    body, pods = settle(job())
    announce(pods[2], 1)
    opened = plan_for(body, pods)
    assert opened.status.barrier is not None
    body = {**body, "status": status_of(opened)}
    paused = [{**p, "metadata": {**p["metadata"], "annotations": {**p["metadata"]["annotations"]}}} for p in pods]
    stuck = plan_for(body, paused, now=NOW + dt.timedelta(seconds=601), policies=[])
    assert condition(stuck, PARITY_LOCKED)[1] == "NoDefaultPolicy"
    assert stuck.status.phase is Phase.FAILED and condition(stuck, READY) == ("False", "WeightUpdateFailed")
    assert set(stuck.delete_pods) >= {"demo-actor-0", "demo-actor-1"}, "no actor is left paused"
    early = plan_for(body, paused, now=NOW + dt.timedelta(seconds=10), policies=[])
    assert early.status.barrier is not None and early.requeue_after is not None, "woken again at the deadline"


def test_an_announcement_older_than_the_committed_weights_is_refused_once() -> None:
    body, pods = settle(job())
    announce(pods[2], 3)
    body, now = carry_barrier(body, pods, 3)
    committed = plan_for(body, pods, now=now)
    body = {**body, "status": status_of(committed)}
    announce(pods[2], 2)
    refused = plan_for(body, pods, now=now)
    assert refused.status.lag is None and refused.status.barrier is None
    [event] = [e for e in refused.events if e.reason == "InvalidWeightsAnnouncement"]
    assert event.type == "Warning" and "older than the committed version 3" in event.message
    again = plan_for({**body, "status": status_of(refused)}, pods, now=now)
    assert not [e for e in again.events if e.reason == "InvalidWeightsAnnouncement"], "reported once, not per pass"


def test_weights_from_outside_the_jobs_own_directory_or_trainer_are_refused() -> None:
    body, pods = settle(job())
    for uri in (
        "file:///var/lib/lockstep/evil.safetensors",
        "file:///var/lib/lockstep/uid-1/../other/weights/v5.safetensors",
        "file:///var/lib/lockstep/uid-1/%2e%2e/other/v5.safetensors",
        "http://evil.example/weights/5",
    ):
        announce(pods[2], 5, uri=uri)
        plan = plan_for(body, pods)
        assert plan.status.barrier is None, uri
        assert any(e.reason == "InvalidWeightsAnnouncement" and uri in e.message for e in plan.events)
    gloo, gloo_pods = settle(job(weightSync={"backend": "gloo"}))
    for uri in (
        "file:///var/lib/lockstep/uid-1/weights/v5.safetensors",
        "http://other-trainer-0.other-trainer.f.svc:9500/weights/5",
        "http://169.254.169.254:80/weights/5",
        "http://user:pw@evil.example/weights/5",
    ):
        announce(gloo_pods[2], 5, uri=uri)
        assert plan_for(gloo, gloo_pods).status.barrier is None, (
            f"a collective job takes weights from its trainer only: {uri}"
        )
    announce(gloo_pods[2], 5)
    assert plan_for(gloo, gloo_pods).status.barrier is not None


def test_the_job_succeeds_only_once_every_actor_serves_the_trainers_last_weights() -> None:
    body, pods = settle(job())
    announce(pods[2], 7)
    pods[2] = running(pods[2], phase="Succeeded", ready=False)
    finishing = plan_for(body, pods)
    assert finishing.status.phase is Phase.RUNNING and not finishing.delete_pods
    assert condition(finishing, READY) == ("True", "FinalWeightUpdate")
    body, now = carry_barrier(body, pods, 7)
    done = plan_for(body, pods, now=now)
    assert done.status.phase is Phase.SUCCEEDED and done.status.weights_version == 7
    ready = find(done.status.conditions, READY)
    assert ready is not None and ready.message.endswith("every actor serves weights version 7")


def test_an_actor_lost_after_the_trainer_completed_is_recreated_for_the_final_update() -> None:
    body, pods = settle(job())
    announce(pods[2], 7)
    pods[2] = running(pods[2], phase="Succeeded", ready=False)
    finishing = plan_for(body, [pods[0], pods[2]])
    assert [p["metadata"]["name"] for p in finishing.create_pods] == ["demo-actor-1"]
    assert condition(finishing, READY) == ("True", "FinalWeightUpdate")


def test_a_refused_final_announcement_does_not_keep_the_job_waiting() -> None:
    body, pods = settle(job())
    announce(pods[2], 7, uri="file:///var/lib/lockstep/evil.safetensors")
    pods[2] = running(pods[2], phase="Succeeded", ready=False)
    done = plan_for(body, pods)
    assert done.status.phase is Phase.SUCCEEDED, "no update it refused is waited for"
    assert any(e.reason == "InvalidWeightsAnnouncement" for e in done.events)


def test_weights_the_actors_cannot_stage_wait_announced_until_a_raised_memory_limit_holds_them() -> None:
    small = {"image": "lockstep/actor:dev", "replicas": 2, "resources": {"limits": {"memory": "1Gi"}}}
    body, pods = settle(job(actors=small))
    announce(pods[2], 3, size=10**9)
    pods = [slim(p) for p in pods]  # as the shell's pod cache holds them: no spec
    held = plan_for(body, pods)
    assert held.status.barrier is None and not held.annotate_pods, "no barrier opens"
    assert condition(held, WEIGHTS_FIT_MEMORY) == ("False", "ActorMemoryLimitTooLow")
    fit = find(held.status.conditions, WEIGHTS_FIT_MEMORY)
    assert fit is not None and fit.message == (
        "actor memory limit 1Gi cannot hold weights version 3 (0.93 GiB) twice: staging needs the model and one "
        "staged copy in host memory, at least 1.87 GiB; raise spec.actors.resources.limits.memory; no barrier "
        "opens for version 3 until then (its announcement stays)"
    )
    [warning] = [e for e in held.events if e.reason == "ActorMemoryLimitTooLow"]
    assert warning.type == "Warning" and fit.message in warning.message
    body = {**body, "status": status_of(held)}
    again = plan_for(body, pods)
    assert again.status.barrier is None and again.status.lag == 3, "the announcement stays"
    assert not [e for e in again.events if e.reason == "ActorMemoryLimitTooLow"], "said once, not on every pass"

    raised = {**small, "resources": {"limits": {"memory": "2Gi"}}}
    body = {**body, "status": status_of(again), "spec": {**body["spec"], "actors": raised}}
    replacing = plan_for(body, pods)
    assert set(replacing.delete_pods) == {"demo-actor-0", "demo-actor-1"} and replacing.status.barrier is None
    body = {**body, "status": status_of(replacing)}
    recreated = plan_for(body, pods[2:])
    actors = [slim(running(p)) for p in recreated.create_pods]
    opened = plan_for({**body, "status": status_of(recreated)}, [*actors, pods[2]])
    assert opened.status.barrier is not None and opened.status.barrier.version == 3, "the same announcement"
    assert condition(opened, WEIGHTS_FIT_MEMORY) == ("True", "WithinMemoryLimit")


def test_a_version_that_keeps_failing_stalls_the_job_naming_it_and_a_newer_one_resumes() -> None:
    """Issue 37, risk: a version no actor could load gave 11 barriers and 12 pod replacements in 70 s, with
    Ready=True and Stalled=False. After STALL_AFTER_FAILURES failed barriers in a row none opens for it; the actors
    keep serving the committed version, and Ready=False WeightUpdateStalled (so Stalled=True) says which and why."""
    from lockstep.barrier import STALL_AFTER_FAILURES

    body, pods = settle(job(weightSync={"onTimeout": "EvictStraggler"}))
    announce(pods[2], 3)
    body, now = carry_barrier(body, pods, 3)
    body = {**body, "status": status_of(plan_for(body, pods, now=now))}
    error = "demo-actor-0 reported error: size of tensor a (128) must match (256)"
    records = [
        {
            "id": f"uid-1/4/{n + 2}",
            "version": 4,
            "outcome": "Failed",
            "seconds": 1.0,
            "phaseSeconds": {},
            "members": 2,
            "finishedAt": "2026-01-01T00:00:00.000Z",
            "error": error,
        }
        for n in range(STALL_AFTER_FAILURES)
    ]
    body["status"]["barrierHistory"] = [*body["status"]["barrierHistory"], *records]
    announce(pods[2], 4)
    stalled = plan_for(body, pods, now=now + dt.timedelta(hours=1))
    assert stalled.status.barrier is None and stalled.status.weights_version == 3 and not stalled.delete_pods
    assert stalled.status.phase is Phase.RUNNING
    assert condition(stalled, READY) == ("False", "WeightUpdateStalled")
    assert condition(stalled, "Stalled") == ("True", "WeightUpdateStalled")
    message = find(stalled.status.conditions, "Stalled").message  # type: ignore[union-attr]
    assert f"weights version 4 failed in {STALL_AFTER_FAILURES} barrier(s) in a row (the last: {error})" in message
    assert "the actors keep serving version 3" in message

    one = {**body, "status": {**body["status"], "barrierHistory": body["status"]["barrierHistory"][:-4]}}
    waiting = plan_for(one, pods, now=now + dt.timedelta(hours=1))
    assert waiting.status.barrier is not None, "one failure long ago: the backoff is over"
    announce(pods[2], 5)
    resumed = plan_for({**body, "status": status_of(stalled)}, pods, now=now + dt.timedelta(hours=1))
    assert resumed.status.barrier is not None and resumed.status.barrier.version == 5, "a newer version opens"
    assert condition(resumed, READY) == ("True", "AllPodsReady")


def test_a_final_version_that_stalls_fails_the_job_instead_of_waiting_for_ever() -> None:
    from lockstep.barrier import STALL_AFTER_FAILURES

    body, pods = settle(job(weightSync={"onTimeout": "EvictStraggler"}))
    record = {"version": 7, "outcome": "Failed", "seconds": 1.0, "phaseSeconds": {}, "members": 2, "error": "boom"}
    history = [{**record, "id": f"uid-1/7/{n + 1}", "finishedAt": "2026-01-01T00:00:00.000Z"} for n in range(5)]
    assert len(history) == STALL_AFTER_FAILURES
    body = {**body, "status": {**body.get("status", {}), "barrierHistory": history, "barriersOpened": 5}}
    announce(pods[2], 7)
    pods[2] = running(pods[2], phase="Succeeded", ready=False)
    done = plan_for(body, pods, now=NOW + dt.timedelta(days=400))
    assert done.status.phase is Phase.FAILED and condition(done, READY) == ("False", "WeightUpdateStalled")
    assert (
        "weights version 7 failed in 5 barrier(s) in a row (the last: boom)"
        in find(done.status.conditions, READY).message
    )  # type: ignore[union-attr]
