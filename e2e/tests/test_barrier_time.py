"""The demo's account of where a barrier's time goes (lockstep_e2e.barrier_time), on an audit log made by hand."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from lockstep import keys
from lockstep_e2e.barrier_time import barrier_times

T0 = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.UTC).timestamp()
TOLERANCE = 1e-5  # audit timestamps have microseconds, and epoch floats a little less


def patch(start: float, end: float, *, pod: str | None, operator: bool) -> dict[str, Any]:
    def stamp(seconds: float) -> str:
        return dt.datetime.fromtimestamp(T0 + seconds, dt.UTC).isoformat().replace("+00:00", "Z")

    ref = {"resource": "pods", "name": pod} if pod else {"resource": "rljobs", "name": "tiny", "subresource": "status"}
    ref["namespace"] = "demo"
    return {
        "stage": "ResponseComplete",
        "verb": "patch",
        "objectRef": ref,
        "user": {"username": keys.OPERATOR_USERNAME if operator else "system:serviceaccount:demo:tiny-worker"},
        "requestReceivedTimestamp": stamp(start),
        "stageTimestamp": stamp(end),
    }


def update(paused: float, pause: float, loaded: float, resumed: float, resume: float) -> dict[str, Any]:
    return {
        "version": 3,
        "pausedAt": T0 + paused,
        "pauseSeconds": pause,
        "loadedAt": T0 + loaded,
        "resumedAt": T0 + resumed,
        "resumeSeconds": resume,
    }


def test_a_barrier_splits_into_the_operator_the_agents_the_api_server_and_the_actors_own_work() -> None:
    a, b = "tiny-actor-0", "tiny-actor-1"
    audit = [
        patch(0.000, 0.010, pod=a, operator=True),  # Update commands: b's is written 5 ms after a's
        patch(0.005, 0.020, pod=b, operator=True),
        patch(0.012, 0.020, pod=None, operator=True),  # the status, beside them
        patch(0.200, 0.210, pod=a, operator=False),  # Updated acks: b is the slowest
        patch(0.500, 0.520, pod=b, operator=False),
        patch(0.530, 0.540, pod=a, operator=True),  # Resume commands
        patch(0.532, 0.550, pod=b, operator=True),
        patch(0.600, 0.610, pod=b, operator=False),  # Resumed acks: a is the slowest
        patch(0.640, 0.660, pod=a, operator=False),
        patch(0.680, 0.690, pod=None, operator=True),  # the status that closes the barrier
        patch(0.700, 0.710, pod="tiny-trainer-0", operator=False),  # not an actor: not on the path
    ]
    updates = {
        a: [update(paused=0.050, pause=0.020, loaded=0.190, resumed=0.630, resume=0.010)],
        b: [update(paused=0.100, pause=0.060, loaded=0.480, resumed=0.590, resume=0.020)],
    }
    elsewhere = [{**e, "objectRef": {**e["objectRef"], "namespace": "other"}} for e in audit]
    assert barrier_times(elsewhere, "demo", "tiny", updates) == [], "a job of the same name elsewhere is not this one"
    (time,) = barrier_times(audit, "demo", "tiny", updates)
    assert time.version == 3
    # b's command 5 ms after the first + 10 ms from b's Updated ack to a's Resume + 20 ms to the closing status
    assert time.operator == pytest.approx(0.005 + 0.010 + 0.020, abs=TOLERANCE)
    # b saw its command 20 ms after it was written and acked 20 ms after loading; a: 80 ms (busy), then 10 ms
    assert time.agents == pytest.approx(0.020 + 0.020 + 0.080 + 0.010, abs=TOLERANCE)
    assert time.api_server == pytest.approx(0.015 + 0.020 + 0.010 + 0.020, abs=TOLERANCE)
    assert time.own_work == pytest.approx((0.480 - 0.040) + 0.010, abs=TOLERANCE)
    assert time.beyond_own_work + time.own_work == pytest.approx(0.680, abs=TOLERANCE), (
        "the shares add up to the barrier"
    )


def test_a_barrier_that_a_write_is_missing_for_or_that_an_actor_did_not_record_is_left_out() -> None:
    a, b = "tiny-actor-0", "tiny-actor-1"
    audit = [patch(0.0, 0.01, pod=a, operator=True), patch(0.2, 0.21, pod=a, operator=False)]
    updates = {a: [update(0.05, 0.02, 0.19, 0.63, 0.01)], b: []}
    assert barrier_times(audit, "demo", "tiny", updates) == []
    assert barrier_times(audit, "demo", "tiny", {a: updates[a]}) == [], (
        "no Resume command, no closing status in the log"
    )


def test_an_updates_latency_runs_from_the_trainers_nth_announcement_to_the_last_actor_resumed() -> None:
    from lockstep_e2e.barrier_time import update_latencies

    a, b = "tiny-actor-0", "tiny-actor-1"
    audit = [
        patch(1.0, 1.010, pod="tiny-trainer-0", operator=False),  # announces version 1
        patch(1.1, 1.110, pod="tiny-trainer-0", operator=True),  # the operator's write: not an announcement
        patch(1.2, 1.210, pod=a, operator=False),  # an actor's ack: not an announcement
        patch(3.0, 3.005, pod="tiny-trainer-0", operator=False),  # version 2
    ]
    updates = {
        a: [{"version": 1, "resumedAt": T0 + 1.5}, {"version": 2, "resumedAt": T0 + 3.2}],
        b: [{"version": 1, "resumedAt": T0 + 1.8}],  # b never took version 2: not counted
    }
    assert update_latencies(audit, "demo", "tiny", updates) == pytest.approx([1.8 - 1.010], abs=TOLERANCE)
