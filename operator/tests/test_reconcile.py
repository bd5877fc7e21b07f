"""The reconciler's decisions, one situation at a time, and properties over many."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from factories import NOW, REWARD, job, policy, running
from lockstep import keys
from lockstep.api import Phase
from lockstep.conditions import PARITY_LOCKED, READY, WEIGHTS_FIT_MEMORY, find
from lockstep.events import PassScope, slim
from lockstep.protocol import ACK_FOR, PROTOCOL, BarrierPhase
from lockstep.reconcile import Observed, Plan, reconcile, restart_backoff_seconds


def plan_for(
    body: dict[str, Any],
    pods: list[dict[str, Any]] | None = None,
    *,
    now: dt.datetime = NOW,
    policies: list[dict[str, Any]] | None = None,
    labels: dict[str, str] | None = None,
) -> Plan:
    return reconcile(Observed(body, pods or [], [policy()] if policies is None else policies, labels or {}, now))


def status_of(plan: Plan) -> dict[str, Any]:
    return plan.status.model_dump(mode="json", by_alias=True, exclude_none=True)


def settle(body: dict[str, Any], ready: bool = True) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Reconcile a new job, 'run' the pods it created, reconcile again: the job as it is once running."""
    first = plan_for(body)
    pods = [running(p, ready=ready) for p in first.create_pods]
    second = plan_for({**body, "status": status_of(first)}, pods)
    return {**body, "status": status_of(second)}, pods


def condition(plan: Plan, type_: str) -> tuple[str, str]:
    found = find(plan.status.conditions, type_)
    assert found is not None
    return found.status.value, found.reason


def test_new_job_creates_its_pods_and_children() -> None:
    plan = plan_for(job())
    assert [p["metadata"]["name"] for p in plan.create_pods] == ["demo-actor-0", "demo-actor-1", "demo-trainer-0"]
    kinds = {"ServiceAccount", "Role", "RoleBinding", "ConfigMap", "Service", "NetworkPolicy"}
    assert {c["kind"] for c in plan.children} == kinds
    role = next(c for c in plan.children if c["kind"] == "Role")
    assert role["rules"][0]["resourceNames"] == ["demo-actor-0", "demo-actor-1", "demo-trainer-0"]
    assert role["rules"][1] == {
        "apiGroups": ["discovery.k8s.io"],
        "resources": ["endpointslices"],
        "verbs": ["list", "watch"],
    }, "the trainer finds the actors in their Service's EndpointSlices, and may do nothing else with them"
    trainer = {e["name"]: e.get("value") for e in plan.create_pods[-1]["spec"]["containers"][0]["env"]}
    assert trainer["LOCKSTEP_ACTORS_SERVICE"] == "demo-actors" and "LOCKSTEP_ACTORS_URL" not in trainer
    assert {p["spec"]["serviceAccountName"] for p in plan.create_pods} == {"demo-worker"}
    assert plan.status.phase is Phase.PENDING
    assert condition(plan, PARITY_LOCKED) == ("True", "Locked")
    assert plan.status.config_fingerprint and plan.status.parity_policy == "default"


def test_job_is_running_once_every_pod_is_ready() -> None:
    body, pods = settle(job())
    assert body["status"]["phase"] == "Running"
    assert body["status"]["actors"] == {"desired": 2, "ready": 2, "summary": "2/2"}
    plan = plan_for(body, pods)
    assert not plan.create_pods and not plan.delete_pods
    assert status_of(plan) == body["status"], "a settled job must not rewrite its status"


def test_trainer_pods_get_the_torch_distributed_environment() -> None:
    plan = plan_for(job(trainer={"image": "t", "reward": REWARD, "replicas": 2}))
    trainers = [p for p in plan.create_pods if p["metadata"]["labels"][keys.ROLE] == keys.TRAINER]
    env = [{e["name"]: e.get("value") for e in p["spec"]["containers"][0]["env"]} for p in trainers]
    assert [e["RANK"] for e in env] == ["0", "1"]
    assert {e["WORLD_SIZE"] for e in env} == {"2"}
    assert {e["MASTER_ADDR"] for e in env} == {"demo-trainer-0.demo-trainer.team-a.svc"}
    assert trainers[1]["spec"]["subdomain"] == "demo-trainer"


def test_enforced_conflict_creates_no_pods_and_names_each_key() -> None:
    plan = plan_for(job(actors={"image": "a", "vllm": {"logprobsMode": "raw_logprobs", "asyncScheduling": True}}))
    assert not plan.create_pods
    assert condition(plan, PARITY_LOCKED) == ("False", "ConflictsWithPolicy")
    message = find(plan.status.conditions, PARITY_LOCKED).message  # type: ignore[union-attr]
    assert "spec.actors.vllm.logprobsMode=raw_logprobs (locked to processed_logprobs)" in message
    assert "spec.actors.vllm.asyncScheduling=true (locked to false)" in message


def test_policy_tightened_later_removes_the_running_pods() -> None:
    body, pods = settle(job(actors={"image": "a", "vllm": {"maxModelLen": 512}}))
    stricter = policy()
    stricter["spec"]["vllm"]["maxModelLen"] = 1024
    plan = plan_for(body, pods, policies=[stricter])
    assert set(plan.delete_pods) == {p["metadata"]["name"] for p in pods}
    assert condition(plan, PARITY_LOCKED) == ("False", "ConflictsWithPolicy")


def test_warn_runs_with_locked_values_and_emits_a_warning() -> None:
    plan = plan_for(
        job(actors={"image": "a", "vllm": {"enablePrefixCaching": True}}), policies=[policy(enforcement="Warn")]
    )
    assert plan.create_pods
    assert "--no-enable-prefix-caching" in plan.create_pods[0]["spec"]["containers"][0]["args"]
    assert condition(plan, PARITY_LOCKED) == ("True", "LockedValuesApplied")
    assert any(e.type == "Warning" and e.reason == "LockedValuesApplied" for e in plan.events)


def test_missing_policy_keeps_existing_pods_and_says_so() -> None:
    body, pods = settle(job())
    plan = plan_for(body, pods, policies=[])
    assert not plan.delete_pods and not plan.create_pods
    status, reason = condition(plan, PARITY_LOCKED)
    assert (status, reason) == ("False", "NoDefaultPolicy")
    assert "the 3 existing pods keep running with the last applied configuration" in (
        find(plan.status.conditions, PARITY_LOCKED).message  # type: ignore[union-attr]
    )


def test_a_pod_with_another_fingerprint_is_drift_and_replaced() -> None:
    body, pods = settle(job())
    pods[0]["metadata"]["annotations"][keys.CONFIG_FINGERPRINT] = "sha256:other"
    plan = plan_for(body, pods)
    assert list(plan.delete_pods) == ["demo-actor-0"]
    assert condition(plan, PARITY_LOCKED) == ("False", "Drift")


def test_scaling_actors_up_and_down() -> None:
    body, pods = settle(job())
    up = plan_for({**body, "spec": {**body["spec"], "actors": {"image": "lockstep/actor:dev", "replicas": 3}}}, pods)
    assert [p["metadata"]["name"] for p in up.create_pods] == ["demo-actor-2"]
    assert up.status.restarts == 0, "a scale-up is not a restart"
    down = plan_for({**body, "spec": {**body["spec"], "actors": {"image": "lockstep/actor:dev", "replicas": 1}}}, pods)
    assert list(down.delete_pods) == ["demo-actor-1"]


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


def test_suspend_deletes_pods_and_keeps_status_and_resume_recreates() -> None:
    body, pods = settle(job())
    suspended = plan_for({**body, "spec": {**body["spec"], "suspend": True}}, pods)
    assert set(suspended.delete_pods) == {p["metadata"]["name"] for p in pods}
    assert suspended.status.phase is Phase.SUSPENDED
    assert suspended.status.config_fingerprint == body["status"]["configFingerprint"]
    resumed = plan_for({**body, "status": status_of(suspended)}, [])
    assert len(resumed.create_pods) == 3 and resumed.status.restarts == 0


def test_trainer_success_finishes_the_job_and_ttl_deletes_it() -> None:
    body, pods = settle(job(ttlSecondsAfterFinished=30))
    pods[2] = running(pods[2], phase="Succeeded", ready=False)
    done = plan_for(body, pods)
    assert done.status.phase is Phase.SUCCEEDED and done.requeue_after == 30
    assert set(done.delete_pods) == {p["metadata"]["name"] for p in pods}
    body = {**body, "status": status_of(done)}
    assert not plan_for(body, [], now=NOW + dt.timedelta(seconds=29)).delete_job
    assert plan_for(body, [], now=NOW + dt.timedelta(seconds=30)).delete_job


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


def test_the_trainers_last_evaluation_reaches_the_status_and_lockstep_status() -> None:
    from lockstep.cli import describe_status

    body, pods = settle(job())
    announce(pods[2], 6)
    evaluated = {"protocol": PROTOCOL, "version": 5, "reward": 0.35, "rows": 20}
    pods[2]["metadata"]["annotations"][keys.EVALUATION] = json.dumps(evaluated)
    status = plan_for(body, pods).status
    assert status.evaluation is not None and (status.evaluation.version, status.evaluation.reward) == (5, 0.35)
    shown = describe_status("tiny", status.model_dump(mode="json", by_alias=True, exclude_none=True))
    assert "  trainer's last evaluation: eval reward 0.35 on weights version 5 (20 eval rows, greedy)" in shown
    pods[2]["metadata"]["annotations"][keys.EVALUATION] = "{not json"
    kept = plan_for({**body, "status": status.model_dump(mode="json", by_alias=True)}, pods).status
    assert kept.evaluation == status.evaluation, "a bad document leaves the last good evaluation"


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


def test_a_mismatch_over_budget_degrades_parity_and_pause_holds_weight_updates() -> None:
    strict = policy(trainer={"mismatchBudget": {"meanAbsLogprobDiff": 0.01, "onExceeded": "Pause"}})
    body, pods = settle(job())
    announce(pods[2], 4)
    measured = {"protocol": PROTOCOL, "step": 4, "meanAbsLogprobDiff": 0.05, "tokenFraction": 0.75}
    pods[2]["metadata"]["annotations"][keys.MISMATCH] = json.dumps(measured)

    held = plan_for(body, pods, policies=[strict])
    assert condition(held, "ParityDegraded") == ("True", "MismatchBudgetExceeded")
    message = find(held.status.conditions, "ParityDegraded").message  # type: ignore[union-attr]
    assert "0.05" in message and "budget 0.01" in message and "weight updates are held" in message
    assert held.status.barrier is None and not held.annotate_pods, "no weight update while held"
    assert any(e.reason == "MismatchBudgetExceeded" and e.type == "Warning" for e in held.events)

    warned = plan_for(body, pods, policies=[policy(trainer={"mismatchBudget": {"meanAbsLogprobDiff": 0.01}})])
    assert condition(warned, "ParityDegraded") == ("True", "MismatchBudgetExceeded")
    assert warned.status.barrier is not None, "Warn (the default) only tells"

    raised = policy(trainer={"mismatchBudget": {"meanAbsLogprobDiff": 0.1, "onExceeded": "Pause"}})
    resumed = plan_for({**body, "status": status_of(held)}, pods, policies=[raised])
    assert condition(resumed, "ParityDegraded") == ("False", "WithinBudget")
    assert resumed.status.barrier is not None and resumed.status.barrier.version == 4


def test_preflight_runs_before_training_and_its_result_decides() -> None:
    body = job(preflight={"enabled": True})
    first = plan_for(body)
    assert [p["metadata"]["name"] for p in first.create_pods] == ["demo-preflight-0"], "only the preflight pod"
    assert first.status.phase is Phase.PENDING and condition(first, READY) == ("False", "Preflight")
    role = next(c for c in first.children if c["kind"] == "Role")
    assert "demo-preflight-0" in role["rules"][0]["resourceNames"], "it may write its result on itself"
    body = {**body, "status": status_of(first)}

    def finished(measured: float, phase: str = "Succeeded") -> Plan:
        pod = running(first.create_pods[0], phase=phase, ready=False)
        result = {
            "protocol": PROTOCOL,
            "meanAbsLogprobDiff": measured,
            "sharedPrefixMeanAbsLogprobDiff": measured / 2,
            "clipFraction": 0.0,
            "outsideTopPPerThousand": 0.0,
            "tokens": 1024,
        }
        pod["metadata"]["annotations"][keys.PREFLIGHT] = json.dumps(result)
        return plan_for(body, [pod])

    passed = finished(1e-3)
    assert passed.status.preflight is not None and passed.status.preflight.tokens == 1024
    assert len(passed.create_pods) == 3 and passed.delete_pods == {"demo-preflight-0": "the preflight check finished"}
    assert any(e.reason == "PreflightPassed" for e in passed.events)

    over = finished(0.5)
    assert over.status.phase is Phase.FAILED and not over.create_pods
    assert condition(over, "ParityLocked") == ("False", "MismatchBudgetExceeded")
    message = find(over.status.conditions, "ParityLocked").message  # type: ignore[union-attr]
    assert "mean |Δlogprob| 0.5" in message and "budget 0.02" in message

    crashed = finished(0.0, phase="Failed")
    assert crashed.status.phase is Phase.FAILED and condition(crashed, READY) == ("False", "PreflightFailed")


def test_condition_transition_time_is_kept_while_status_is_unchanged() -> None:
    body, pods = settle(job())
    later = plan_for(body, pods, now=NOW + dt.timedelta(hours=1))
    ready = find(later.status.conditions, READY)
    assert ready is not None and ready.last_transition_time == body["status"]["conditions"][1]["lastTransitionTime"]


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


def announce(trainer: dict[str, Any], version: int, uri: str | None = None, size: int | None = None) -> None:
    """What trainer rank 0 writes: by default weights where its backend publishes them (factories.job's uid);
    ``size``: the version's size in bytes, when given."""
    env = {e["name"]: e.get("value") for e in trainer["spec"]["containers"][0]["env"]}
    if uri is None and env["LOCKSTEP_WEIGHT_SYNC"] == "filesystem":
        uri = f"file:///var/lib/lockstep/uid-1/weights/v{version}.safetensors"
    uri = uri or f"http://{env['LOCKSTEP_WEIGHTS_HOST']}:9500/weights/{version}"
    weights = {"protocol": PROTOCOL, "version": version, "uri": uri, "digest": f"sha256:{version}"}
    trainer["metadata"]["annotations"][keys.WEIGHTS] = json.dumps(weights | ({"bytes": size} if size else {}))


def carry_barrier(
    body: dict[str, Any], pods: list[dict[str, Any]], version: int, members: int = 2, now: dt.datetime = NOW
) -> tuple[dict[str, Any], dt.datetime]:
    """Let the first ``members`` pods (the two actors; and the trainer with a collective backend) ack every
    phase of the barrier to ``version``, from ``now`` on; the job as of then, and the time."""
    for expected_phase, ack_phase in (("Update", "Updated"), ("Resume", "Resumed")):
        plan = plan_for(body, pods, now=now)
        assert set(plan.annotate_pods) == {p["metadata"]["name"] for p in pods[:members]}, "commands go to members"
        for pod in pods[:members]:
            command = json.loads(plan.annotate_pods[pod["metadata"]["name"]][keys.BARRIER])
            assert command["phase"] == expected_phase and command["version"] == version
            pod["metadata"]["annotations"][keys.BARRIER] = plan.annotate_pods[pod["metadata"]["name"]][keys.BARRIER]
            ack = {"protocol": PROTOCOL, "id": command["id"], "phase": ack_phase, "loadedVersion": version}
            pod["metadata"]["annotations"][keys.BARRIER_ACK] = json.dumps(ack)
        body = {**body, "status": status_of(plan)}
        now += dt.timedelta(seconds=1)
    return body, now


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


def test_stalled_and_reconciling_follow_ready_for_kstatus() -> None:
    def gitops(plan: Plan) -> tuple[tuple[str, str], ...]:
        return tuple(condition(plan, kind) for kind in ("Ready", "Reconciling", "Stalled"))

    first = plan_for(job())
    assert gitops(first) == (("False", "PodsNotReady"), ("True", "PodsNotReady"), ("False", "NotStalled"))
    body, pods = settle(job())
    assert gitops(plan_for(body, pods)) == (("True", "AllPodsReady"), ("False", "Reconciled"), ("False", "NotStalled"))
    conflicting = plan_for(job(actors={"image": "a", "vllm": {"logprobsMode": "raw_logprobs"}}))
    assert gitops(conflicting)[2] == ("True", "ConflictsWithPolicy")
    assert gitops(conflicting)[1] == ("False", "Reconciled")
    suspended = plan_for({**body, "spec": {**body["spec"], "suspend": True}}, pods)
    assert gitops(suspended) == (("False", "Suspended"), ("False", "Reconciled"), ("False", "NotStalled"))
    pods[2] = running(pods[2], phase="Succeeded", ready=False)
    done = plan_for(body, pods)
    assert gitops(done) == (("True", "TrainerSucceeded"), ("False", "Reconciled"), ("False", "NotStalled"))
    reasons = [e.reason for e in done.events]
    assert reasons.count("TrainerSucceeded") == 1, "one Event for the transition, not two"


# -- hardening: replacements, rejected children, announcements, a barrier that must always end -------------


def pass_after(plan: Plan, body: dict[str, Any], pods: list[dict[str, Any]], **spec: Any) -> tuple[Plan, Any]:
    """The next pass, once the pods ``plan`` deleted are gone: (that plan, the job it leaves)."""
    body = {**body, "spec": {**body["spec"], **spec}, "status": status_of(plan)}
    left = [p for p in pods if p["metadata"]["name"] not in plan.delete_pods]
    return plan_for(body, left), body


def test_replacements_the_user_asked_for_never_count_as_restarts() -> None:
    body, pods = settle(job(maxRestarts=1))
    for edit in range(4):
        edited = {**body, "spec": {**body["spec"], "actors": {"image": f"actor:v{edit}", "replicas": 2}}}
        replacing = plan_for(edited, pods)
        assert set(replacing.delete_pods) == {"demo-actor-0", "demo-actor-1"}
        assert replacing.status.replacing == ["demo-actor-0", "demo-actor-1"]
        recreated, body = pass_after(replacing, edited, pods)
        assert recreated.status.restarts == 0 and recreated.status.phase is not Phase.FAILED
        assert [p["metadata"]["name"] for p in recreated.create_pods] == ["demo-actor-0", "demo-actor-1"]
        pods = [running(p) for p in recreated.create_pods] + [p for p in pods if "trainer" in p["metadata"]["name"]]
        settled = plan_for({**body, "status": status_of(recreated)}, pods)
        assert settled.status.replacing == [] and settled.status.replacements == 2 * (edit + 1)
        body = {**body, "status": status_of(settled)}
    lost = plan_for(body, pods[1:])
    assert lost.status.restarts == 1, "a pod that vanished on its own is still a failure"


def test_a_trainer_rank_is_replaced_with_its_group() -> None:
    body, pods = settle(job(trainer={"image": "t", "reward": REWARD, "replicas": 2}))
    pods[3] = {**pods[3], "metadata": {**pods[3]["metadata"], "annotations": {keys.CONFIG_FINGERPRINT: "sha256:old"}}}
    drifted = plan_for(body, pods)
    assert set(drifted.delete_pods) == {"demo-trainer-0", "demo-trainer-1"}
    assert drifted.status.replacements == 2 and drifted.status.restarts == 0
    after, _ = pass_after(drifted, body, pods)
    assert after.status.restarts == 0 and len(after.create_pods) == 2


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


def test_what_the_api_server_refused_is_a_condition_and_nothing_more_is_created() -> None:
    refused = {"Pod demo-actor-0": 'Pod "demo-actor-0" is invalid: spec.containers[0].resources.limits: lots'}
    plan = reconcile(Observed(job(), [], [policy()], {}, NOW, rejected=refused))
    assert not plan.create_pods and not plan.children
    assert condition(plan, READY) == ("False", "ChildRejected")
    assert condition(plan, "Stalled") == ("True", "ChildRejected")
    message = find(plan.status.conditions, READY).message  # type: ignore[union-attr]
    assert "Pod demo-actor-0" in message and "lots" in message and "fix the RLJob's spec" in message
    assert any(e.reason == "ChildRejected" and e.type == "Warning" for e in plan.events)


def test_a_pod_name_held_by_a_pod_not_of_the_job_is_named_with_its_owner_and_what_to_do() -> None:
    """Issue 21 item 6: the shell found the name taken on create (409) by a pod not labelled as the job's."""
    squatter = {"name": "demo-trainer-0", "labels": {"app": "mine"}, "managedFields": [{"manager": "kubectl-create"}]}
    body, pods = settle(job())
    plan = reconcile(Observed(body, pods[:2], [policy()], {}, NOW, taken={"demo-trainer-0": squatter}))
    assert not plan.create_pods, "the job needs all its pods: nothing more is created"
    assert condition(plan, READY) == ("False", "PodNameTaken") and condition(plan, "Stalled") == (
        "True",
        "PodNameTaken",
    )
    message = find(plan.status.conditions, READY).message  # type: ignore[union-attr]
    assert "pod demo-trainer-0 exists and is not Lockstep's" in message
    assert "owned by nobody, written by kubectl-create" in message
    assert "kubectl delete pod -n team-a demo-trainer-0" in message and "under another name" in message
    assert [e.type for e in plan.events if e.reason == "PodNameTaken"] == ["Warning"]

    relabelled = {"name": "demo-actor-1", "labels": {}, "ownerReferences": [{"kind": "RLJob", "uid": "uid-1"}]}
    plan = reconcile(Observed(body, [pods[0], pods[2]], [policy()], {}, NOW, taken={"demo-actor-1": relabelled}))
    message = find(plan.status.conditions, READY).message  # type: ignore[union-attr]
    assert "pod demo-actor-1 is this RLJob's own pod, but its labels no longer mark it as the job's" in message
    owned = {**squatter, "ownerReferences": [{"kind": "ReplicaSet", "name": "web-1", "uid": "u"}]}
    plan = reconcile(Observed(body, pods[:2], [policy()], {}, NOW, taken={"demo-trainer-0": owned}))
    assert "owned by ReplicaSet web-1" in find(plan.status.conditions, READY).message  # type: ignore[union-attr]


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


def test_the_job_is_isolated_by_a_network_policy_unless_turned_off() -> None:
    scraper = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    plan = plan_for(job(networkPolicy={"metricsFrom": [scraper]}))
    [isolation] = [c for c in plan.children if c["kind"] == "NetworkPolicy"]
    own = {"matchLabels": {keys.MANAGED_BY: keys.MANAGER, keys.JOB: "demo", "app.kubernetes.io/instance": "demo"}}
    assert isolation["spec"]["podSelector"] == own and isolation["spec"]["policyTypes"] == ["Ingress"]
    assert isolation["spec"]["ingress"][0] == {"from": [{"podSelector": own}]}, "every port, from the job's pods"
    assert isolation["spec"]["ingress"][1]["from"] == [scraper]
    assert {p["port"] for p in isolation["spec"]["ingress"][1]["ports"]} == {8000, 9400}
    for pod in plan.create_pods:
        assert all(pod["metadata"]["labels"][k] == v for k, v in own["matchLabels"].items())
    off = plan_for(job(networkPolicy={"enabled": False}))
    assert "NetworkPolicy" not in {c["kind"] for c in off.children}
    assert off.remove_children == [("NetworkPolicy", "demo-isolation")]


def test_a_pod_that_requests_gpus_gets_its_local_rank_shared_memory_and_nccl_settings() -> None:
    trainer = {
        "image": "t",
        "reward": REWARD,
        "replicas": 2,
        "resources": {"limits": {"nvidia.com/gpu": 1}},
        "env": [{"name": "NCCL_SOCKET_IFNAME", "value": "eth0"}],
    }
    pods = {p["metadata"]["name"]: p for p in plan_for(job(trainer=trainer)).create_pods}
    for rank in (0, 1):
        pod = pods[f"demo-trainer-{rank}"]
        [container] = pod["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["LOCAL_RANK"] == "0" and env["RANK"] == str(rank)
        assert env["NCCL_SOCKET_IFNAME"] == "eth0"
        assert {"name": "lockstep-shm", "mountPath": "/dev/shm"} in container["volumeMounts"]
        assert {"name": "lockstep-shm", "emptyDir": {"medium": "Memory"}} in pod["spec"]["volumes"]
    [actor] = pods["demo-actor-0"]["spec"]["containers"]
    assert "LOCAL_RANK" not in {e["name"] for e in actor["env"]}, "the actors request no GPU here"
    assert all(m["mountPath"] != "/dev/shm" for m in actor["volumeMounts"])


def test_every_pod_runs_as_the_worker_user_on_a_read_only_root_with_writable_scratch_dirs() -> None:
    """Pod Security "restricted" (e2e: test_pod_security); a role's own HOME and its own mount at /tmp replace the
    operator's defaults, never giving the container a name or a mount path twice."""
    trainer = {
        "image": "t",
        "reward": REWARD,
        "env": [{"name": "HOME", "value": "/scratch"}],
        "volumes": [{"name": "scratch", "emptyDir": {"sizeLimit": "10Gi"}}],
        "volumeMounts": [{"name": "scratch", "mountPath": "/tmp"}],
    }
    pods = {p["metadata"]["name"]: p for p in plan_for(job(trainer=trainer, preflight={"enabled": True})).create_pods}
    pods |= {p["metadata"]["name"]: p for p in plan_for(job(trainer=trainer)).create_pods}
    assert set(pods) == {"demo-preflight-0", "demo-actor-0", "demo-actor-1", "demo-trainer-0"}
    for pod in pods.values():
        security = pod["spec"]["securityContext"]
        assert security["runAsNonRoot"] and security["seccompProfile"] == {"type": "RuntimeDefault"}
        assert security["runAsUser"] == security["runAsGroup"] == security["fsGroup"] == 10001
        [container] = pod["spec"]["containers"]
        assert container["securityContext"] == {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        }
        names = [e["name"] for e in container["env"]]
        paths = [m["mountPath"] for m in container["volumeMounts"]]
        assert len(names) == len(set(names)) and len(paths) == len(set(paths))
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        mounted = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
        env = {e["name"]: e.get("value") for e in container["env"]}
        if pod["metadata"]["labels"][keys.ROLE] == keys.TRAINER:
            assert env["HOME"] == "/scratch" and mounted["/tmp"]["name"] == "scratch"
        else:
            assert env["HOME"] == "/home/lockstep" and mounted["/tmp"] == {"name": "lockstep-tmp", "emptyDir": {}}
        assert mounted["/home/lockstep"] == {"name": "lockstep-home", "emptyDir": {}}


def test_each_pod_mounts_only_its_jobs_directory_of_the_shared_volume_and_only_the_trainer_writes() -> None:
    for spec in ({}, {"weightSync": {"backend": "gloo"}}, {"preflight": {"enabled": True}}):
        for pod in plan_for(job(**spec)).create_pods:
            [container] = pod["spec"]["containers"]
            mounts = [m for m in container["volumeMounts"] if m["name"] == "lockstep-shared"]
            role = pod["metadata"]["labels"][keys.ROLE]
            if not mounts:  # a collective job's actors take weights from the trainer, never from a volume
                assert spec and role == keys.ACTOR
                continue
            [shared] = mounts
            assert shared == {
                "name": "lockstep-shared",
                "mountPath": "/var/lib/lockstep/uid-1",
                "subPath": "uid-1",
                "readOnly": role != keys.TRAINER,
            }, pod["metadata"]["name"]
            env = {e["name"]: e.get("value") for e in container["env"]}
            assert env["LOCKSTEP_SHARED_DIR"] == shared["mountPath"]


ack_moves = st.sampled_from(["answer"] * 4 + ["none", "error", "stale", "unreadable"])  # mostly barriers that end


@settings(max_examples=200)
@given(
    backend=st.sampled_from(["filesystem", "gloo"]),
    on_timeout=st.sampled_from(["FailJob", "EvictStraggler"]),
    rounds=st.lists(
        st.tuples(
            st.lists(ack_moves, min_size=3, max_size=3),
            st.sampled_from([0, 1, 700]),
            st.sampled_from(["works", "announces", "completes"]),
        ),
        min_size=1,
        max_size=8,
    ),
)
def test_a_pass_for_acks_alone_decides_what_the_whole_pipeline_decides(
    backend: str, on_timeout: str, rounds: list[tuple[list[str], int, str]]
) -> None:
    """Whatever the members ack, a pass of the barrier step alone (PassScope.BARRIER, asked for only when nothing
    but acks changed since a pass that stepped the barrier) plans what a pass of the whole pipeline plans, apart
    from the children it re-applies."""
    weight_sync: dict[str, Any] = {"onTimeout": on_timeout}
    if backend == "gloo":
        weight_sync["backend"] = "gloo"
    body, pods = settle(job(weightSync=weight_sync))
    announce(pods[2], 3)
    now, stepped = NOW, False
    for moves, seconds, trainer in [([], 0, "works"), *rounds]:  # the first pass opens the barrier
        observed = Observed(body, pods, [policy()], {}, now)
        whole = reconcile(observed)
        if stepped:
            alone = reconcile(dataclasses.replace(observed, scope=PassScope.BARRIER))
            assert status_of(alone) == status_of(whole)
            for field in ("annotate_pods", "delete_pods", "create_pods", "events", "requeue_after", "waiting_for"):
                assert getattr(alone, field) == getattr(whole, field), field
        body = {**body, "status": status_of(whole)}
        if whole.status.phase in (Phase.FAILED, Phase.SUCCEEDED):
            return
        for pod in pods:
            name, annotations = pod["metadata"]["name"], pod["metadata"]["annotations"]
            annotations.update(whole.annotate_pods.get(name, {}))
            if name in whole.delete_pods:  # its replacement runs: a pod event, which asks for the whole pipeline
                pod["metadata"]["uid"] += "-new"
                annotations.pop(keys.BARRIER, None)
                annotations.pop(keys.BARRIER_ACK, None)
        for pod, move in zip(pods, moves, strict=False):
            text = pod["metadata"]["annotations"].get(keys.BARRIER)
            if text is None or move == "none":
                continue
            command = json.loads(text)
            ack = {
                "protocol": PROTOCOL,
                "id": command["id"] if move != "stale" else "uid-1/0/1",
                "phase": ACK_FOR[BarrierPhase(command["phase"])],
                "loadedVersion": command["version"] if move == "answer" else None,
                "retry": command.get("retry", 0),
            }
            if move == "error":
                ack["error"] = "OSError: the volume is gone"
            pod["metadata"]["annotations"][keys.BARRIER_ACK] = "{not json" if move == "unreadable" else json.dumps(ack)
        if trainer == "announces":  # newer weights: a pod event, which asks for the whole pipeline
            announce(pods[2], 4 + len(body["status"].get("barrierHistory", [])))
        elif trainer == "completes":  # so is this one; the acks after it come to a job in its final update
            pods[2]["status"] = {**pods[2]["status"], "phase": "Succeeded"}
        stepped = whole.waiting_for is not None and not whole.delete_pods and trainer == "works"
        now += dt.timedelta(seconds=seconds)


@settings(max_examples=50, deadline=None)
@given(acked=st.sampled_from([0, 1, 2]), waited=st.integers(0, 3600))
def test_suspending_a_job_mid_barrier_closes_the_barrier_as_interrupted(acked: int, waited: int) -> None:
    body, pods = settle(job())
    announce(pods[2], 1)
    opened = plan_for(body, pods)
    for pod in pods[:acked]:
        command = json.loads(opened.annotate_pods[pod["metadata"]["name"]][keys.BARRIER])
        ack = {"protocol": PROTOCOL, "id": command["id"], "phase": "Updated", "loadedVersion": 1}
        pod["metadata"]["annotations"][keys.BARRIER_ACK] = json.dumps(ack)
    body = {**body, "status": status_of(opened)}
    later = NOW + dt.timedelta(seconds=waited)  # past the deadline, too: the suspension closes it, not a timeout
    suspended = plan_for({**body, "spec": {**body["spec"], "suspend": True}}, pods, now=later)
    assert suspended.status.barrier is None
    (record,) = suspended.status.barrier_history
    assert (record.outcome.value, record.reason, record.seconds) == ("Interrupted", "Suspended", waited)
    assert suspended.status.weights_version is None and suspended.status.phase is Phase.SUSPENDED
    (event,) = [e for e in suspended.events if e.reason == "WeightUpdateInterrupted"]
    assert event.type == "Warning" and "suspended" in event.message and "version 1" in event.message
    again = plan_for({**body, "spec": {**body["spec"], "suspend": True}, "status": status_of(suspended)}, [], now=later)
    assert not [e for e in again.events if e.reason == "WeightUpdateInterrupted"], "said once"


QUOTA_MESSAGE = (
    'pods "demo-actor-1" is forbidden: exceeded quota: team-pods, requested: count/pods=1, used: count/pods=2, '
    "limited: count/pods=2"
)


def test_a_resource_quota_that_refuses_some_pods_makes_the_job_release_all_of_them() -> None:
    body, pods = settle(job())
    got = [p for p in pods if p["metadata"]["name"] != "demo-actor-1"]
    refused = {"Pod demo-actor-1": QUOTA_MESSAGE}
    plan = reconcile(Observed(body, got, [policy()], {}, NOW, rejected=refused))
    assert set(plan.delete_pods) == {p["metadata"]["name"] for p in got}, "a job runs all its pods or none"
    assert not plan.create_pods
    assert condition(plan, READY) == ("False", "QuotaExceeded")
    assert condition(plan, "Stalled") == ("False", "NotStalled"), "it waits for quota, like a queued job"
    message = find(plan.status.conditions, READY).message  # type: ignore[union-attr]
    assert "ResourceQuota team-pods in namespace team-a" in message and "Kueue" in message
    assert plan.status.phase is Phase.PENDING and plan.status.actors.ready == 0
    assert any(e.reason == "QuotaExceeded" and e.type == "Warning" for e in plan.events)
    other = {"Pod demo-actor-1": 'Pod "demo-actor-1" is invalid: spec.containers[0].image: Required value'}
    kept = reconcile(Observed(body, got, [policy()], {}, NOW, rejected=other))
    assert not kept.delete_pods, "another refusal keeps the pods that run"
