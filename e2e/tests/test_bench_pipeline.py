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
