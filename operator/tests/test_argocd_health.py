"""The Argo CD health check in charts/lockstep, run in Lua 5.1 (as Argo CD's gopher-lua is) against
RLJob statuses that the reconciler itself produces."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lupa.lua51 import LuaRuntime

from factories import NOW, job, policy, running
from lockstep import kueue
from lockstep.reconcile import KueueView, Observed, reconcile
from reconcile_helpers import plan_for, settle, status_of

SCRIPT = Path(__file__).resolve().parents[2] / "charts" / "lockstep" / "argocd-health.lua"


def health(body: dict[str, Any]) -> tuple[str, str]:
    lua = LuaRuntime(unpack_returned_tuples=True)
    lua.globals().obj = lua.table_from(body, recursive=True)
    result = lua.execute(SCRIPT.read_text())
    return str(result["status"]), str(result["message"])


def test_a_new_job_is_progressing_until_the_operator_has_seen_it() -> None:
    assert health(job())[0] == "Progressing"
    body = job()
    pending = {**body, "status": status_of(plan_for(body))}
    status, message = health(pending)
    assert status == "Progressing" and message.startswith("PodsNotReady: 0/2 actors")


def test_a_running_job_is_healthy_and_a_new_generation_is_progressing() -> None:
    body, _ = settle(job())
    assert health(body) == ("Healthy", "2/2 actors and 1/1 trainer pods ready")
    newer = {**body, "metadata": {**body["metadata"], "generation": 2}}
    assert health(newer)[0] == "Progressing"


def test_a_job_that_needs_a_person_is_degraded() -> None:
    body = job(actors={"image": "a", "vllm": {"logprobsMode": "raw_logprobs"}})
    status, message = health({**body, "status": status_of(plan_for(body))})
    assert status == "Degraded" and message.startswith("ConflictsWithPolicy: ParityPolicy 'default' (Enforce)")


def test_failed_is_degraded_succeeded_is_healthy_suspended_is_suspended() -> None:
    body, pods = settle(job(maxRestarts=0))
    failed_pods = [running(pods[0], phase="Failed", ready=False), *pods[1:]]
    failed = {**body, "status": status_of(plan_for(body, failed_pods))}
    assert health(failed)[0] == "Degraded"
    done_pods = [*pods[:2], running(pods[2], phase="Succeeded", ready=False)]
    assert health({**body, "status": status_of(plan_for(body, done_pods))}) == (
        "Healthy",
        "the trainer (rank 0) completed",
    )
    suspended = {**body, "spec": {**body["spec"], "suspend": True}}
    assert health(suspended)[0] == "Suspended"


def test_a_job_waiting_in_a_kueue_queue_is_suspended() -> None:
    body = job()
    body["metadata"]["labels"] = {kueue.QUEUE_LABEL: "team-queue"}
    queued = {**body, "status": status_of(reconcile(Observed(body, [], [policy()], {}, NOW, kueue=KueueView())))}
    status, message = health(queued)
    assert status == "Suspended" and message.startswith("waiting in LocalQueue team-queue")
