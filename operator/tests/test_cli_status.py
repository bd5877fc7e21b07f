"""``lockstep status`` lines, from a status document alone."""

from __future__ import annotations

from lockstep.cli import describe_status


def test_status_shows_the_stale_samples_the_last_step_dropped() -> None:
    measured = {"step": 7, "meanAbsLogprobDiff": 1.5e-7, "tokenFraction": 0.5}
    shown = describe_status("tiny", {"mismatch": {**measured, "staleSamplesDropped": 3}}).splitlines()
    expected = "  trainer's last parity measurement: step 7, mean |Δlogprob| 1.5e-07 on 50% of its tokens"
    assert f"{expected}; 3 stale sample(s) dropped" in shown
    assert expected in describe_status("tiny", {"mismatch": measured}).splitlines(), "none dropped: not mentioned"


def test_status_says_why_a_barrier_was_interrupted_and_shows_none_in_flight() -> None:
    record = {"version": 3, "outcome": "Interrupted", "reason": "Preempted", "seconds": 2.5, "phaseSeconds": {}}
    shown = describe_status("tiny", {"barrierHistory": [record]})
    assert "  v3 Interrupted (Preempted) in 2.50 s (); slowest None" in shown.splitlines()
    assert "barrier in flight" not in shown
