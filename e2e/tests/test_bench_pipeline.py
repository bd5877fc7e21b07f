"""The pipeline benchmark runs at a tiny size, both loops, over the stub actor's real HTTP API."""

from __future__ import annotations

from lockstep_e2e.bench_pipeline import MAX_TOKENS, SteadyActor, run, serve
from lockstep_e2e.cluster import free_port


def test_the_benchmark_runs_both_loops_against_the_stub_actor() -> None:
    actor = SteadyActor(rate=MAX_TOKENS / 0.02)
    port = free_port()
    serve(actor, port)
    for loop in ("before", "after"):
        result = run(loop, 1, steps=3, sample=0.02, learn=0.02, actor=actor, url=f"http://127.0.0.1:{port}")
        assert (result.loop, result.max_lag, result.stale_samples_dropped) == (loop, 1, 0)
        assert 0 <= result.actor_idle_fraction <= 1 and 0 <= result.trainer_idle_fraction <= 1, result
        assert actor.serving == 3, "every step published its version"


def test_a_runs_step_time_is_the_median_of_its_steady_steps_and_names_its_parts() -> None:
    from lockstep_e2e.rl import step_time

    def record(seconds: float, busy: float, learn: float, dropped: float = 0.0) -> dict[str, float]:
        return {
            "seconds": seconds,
            "actor_busy_fraction": busy,
            "learn_seconds": learn,
            "publish_gather_seconds": 0.1,
            "stale_samples_dropped": dropped,
        }

    first = record(30.0, 0.1, 5.0, dropped=2)  # vLLM warming up: not the steady state
    steady = [record(2.0, 0.5, 1.0), record(3.0, 0.5, 1.5, dropped=1), record(2.0, 1.0, 0.5)]
    timed = step_time([first, *steady], updating=0.4)
    assert (timed.step, timed.generating, timed.learning, timed.gathering) == (2.0, 1.5, 1.0, 0.1)
    assert timed.parts == 3.0 and timed.longest == 1.5 and timed.stale_samples_dropped == 3, timed
    said = timed.said()
    assert "a step took 2.00s (median), 0.67x the sum of its parts (3.00s" in said, said
    assert "the weight update 0.40s" in said and "1.33x the longer" in said, said
