"""The suspend step (lockstep.reconcile's pipeline, step 4): spec.suspend stops the pods and keeps the status."""

from __future__ import annotations

import datetime as dt
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from factories import NOW, job
from lockstep import keys
from lockstep.api import Phase
from lockstep.protocol import PROTOCOL
from reconcile_helpers import announce, plan_for, settle, status_of


def test_suspend_deletes_pods_and_keeps_status_and_resume_recreates() -> None:
    body, pods = settle(job())
    suspended = plan_for({**body, "spec": {**body["spec"], "suspend": True}}, pods)
    assert set(suspended.delete_pods) == {p["metadata"]["name"] for p in pods}
    assert suspended.status.phase is Phase.SUSPENDED
    assert suspended.status.config_fingerprint == body["status"]["configFingerprint"]
    resumed = plan_for({**body, "status": status_of(suspended)}, [])
    assert len(resumed.create_pods) == 3 and resumed.status.restarts == 0


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
