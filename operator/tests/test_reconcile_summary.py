"""The summary that closes every pass (lockstep.reconcile.summary): the conditions kstatus reads, an
Event per transition."""

from __future__ import annotations

import datetime as dt

from factories import NOW, job, running
from lockstep.conditions import READY, find
from lockstep.reconcile import Plan
from reconcile_helpers import condition, plan_for, settle


def test_condition_transition_time_is_kept_while_status_is_unchanged() -> None:
    body, pods = settle(job())
    later = plan_for(body, pods, now=NOW + dt.timedelta(hours=1))
    ready = find(later.status.conditions, READY)
    assert ready is not None and ready.last_transition_time == body["status"]["conditions"][1]["lastTransitionTime"]


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
