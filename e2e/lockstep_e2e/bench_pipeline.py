"""Benchmark: the rollout pipeline's scheduling alone, with stubs (``make bench-pipeline``; writes
out/benchmarks/pipeline.json).

``python -m lockstep_e2e.bench_pipeline [--steps 12] [--sample-seconds 0.4] [--learn-seconds 0.4] [--lags 0 1 2]``
``python -m lockstep_e2e.bench_pipeline --demo [--steps 20] [--lags 0 1 2]`` (out/benchmarks/pipeline-demo.json)

With stubs (the default):

- the actor: the real actor's HTTP API (lockstep_workers.actor.server.application: /generate, /ready, /metrics with its
  busy-seconds counter) over an ``Actor`` whose generation emits ``max_tokens`` tokens at a fixed rate, each
  tagged with the version it serves at that moment; it serves a new version the moment the learner publishes;
- the learner: takes ``learn-seconds`` a step, then publishes the next version;
- the trainer's client: the real ``ActorService`` over HTTP.
For each maxLag: **before**, the serial loop the trainer ran up to issue 23 (wait until the actors serve a version
within maxLag, sample the step's prompts, learn, publish); **after**, ``RolloutProducer`` (groupsInFlight at its
default, 2 x promptsPerStep). Reported, in the steady state (after the first step): the step's wall time (median)
against the max and the sum of the sample and learn times, the actors' idle fraction (from their own busy seconds)
and the trainer's (not learning), and samples dropped as stale.

With ``--demo``: the demo's own RLJob (lockstep_e2e.demo: a local control plane, the operator, two vLLM actors and
two trainer ranks on this machine's CPUs, its tuned settings) for ``--steps`` steps at each maxLag, without the
preflight; from its metrics.jsonl (lockstep_e2e.rl.step_time), the step's median wall time against the sum and
the longer of its parts (the actors generating, learning, gathering the weights, the weight update from the
announcement to the last actor resumed), the actors' idle fraction, the trainer's (not learning), and samples
dropped as stale. The actors and the trainer share the same cores here, so
overlapping them gains less than on separate machines: what it reports is what this machine gives.

Not a test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import shutil
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from lockstep_e2e.benchmarks import write_results
from lockstep_e2e.cluster import free_port
from lockstep_e2e.install import REPO
from lockstep_e2e.rl import StepTime, merged, run_tiny_rl_job, step_time, update_seconds
from lockstep_workers.actor.server import Actor, application
from lockstep_workers.actor.vllm_args import AppliedSettings
from lockstep_workers.rollout.client import ActorService, FixedActors
from lockstep_workers.rollout.dataset import Prompt
from lockstep_workers.rollout.producer import RolloutProducer, Schedule
from lockstep_workers.rollout.record import Rollout
from lockstep_workers.rollout.scoring import Scores

PROMPTS_PER_STEP = 4
SAMPLES_PER_PROMPT = 4
MAX_TOKENS = 16


class SteadyActor(Actor):
    """An actor without an engine: ``max_tokens`` tokens at ``rate`` tokens a second per request."""

    def __init__(self, rate: float) -> None:
        super().__init__(None)
        self.rate = rate

    async def generate(self, prompt_token_ids: list[int], sampling: dict[str, Any]) -> dict[str, Any]:
        tokens, versions = [], []
        for _ in range(int(sampling.get("max_tokens", MAX_TOKENS))):
            await asyncio.sleep(1 / self.rate)
            tokens.append(7)
            versions.append(self.serving)
        return {"token_ids": tokens, "logprobs": [-1.0] * len(tokens), "weights_versions": versions}


def serve(actor: Actor, port: int) -> None:
    """The actor's HTTP API on 127.0.0.1:``port``, in a daemon thread."""
    ready = threading.Event()
    ready.set()
    app = application(actor, ready, AppliedSettings({}, {}))
    started = threading.Event()

    async def run() -> None:
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        started.set()
        await asyncio.Event().wait()

    threading.Thread(target=asyncio.run, args=(run(),), daemon=True).start()
    started.wait()


@dataclass
class Result:
    loop: str
    max_lag: int
    sample_seconds: float
    learn_seconds: float
    step_seconds: float
    step_over_max: float
    step_over_sum: float
    actor_idle_fraction: float
    trainer_idle_fraction: float
    stale_samples_dropped: int


def prompt_at(position: int) -> Prompt:
    return Prompt([1, 3 + position % 200], str(position), {})


def no_reward(rollouts: list[Rollout], prompt: Prompt) -> tuple[list[Any], Scores]:
    return [None] * len(rollouts), Scores([0.0] * len(rollouts), {}, 0)


def run(loop: str, max_lag: int, steps: int, sample: float, learn: float, actor: Actor, url: str) -> Result:
    """``steps`` steps of ``loop`` (before: serial; after: the producer); the actor starts at version 0."""
    actor.serving = 0
    service = ActorService(FixedActors([url]))
    sampling = {"max_tokens": MAX_TOKENS}
    producer = None
    if loop == "after":
        schedule = Schedule(PROMPTS_PER_STEP, max_lag, 2 * PROMPTS_PER_STEP, 0, steps * PROMPTS_PER_STEP)
        producer = RolloutProducer(service, schedule, prompt_at, SAMPLES_PER_PROMPT, sampling, no_reward)
    started = time.monotonic()
    if producer is not None:
        producer.start()
    boundaries, learning = [started], 0.0
    for step in range(1, steps + 1):
        if producer is not None:
            producer.take(step)
        else:
            service.wait_for_version(step - 1 - max_lag)
            positions = range((step - 1) * PROMPTS_PER_STEP, step * PROMPTS_PER_STEP)
            service.sample([prompt_at(p).token_ids for p in positions], SAMPLES_PER_PROMPT, sampling)
        time.sleep(learn)  # the learner stub
        learning += learn
        actor.serving = step  # published and served at once
        boundaries.append(time.monotonic())
        if step == 1:  # the steady state: from the end of the first step
            busy_before, learning = asyncio.run(service.busy_seconds())[url], 0.0
            boundaries[-1] = time.monotonic()
    wall = boundaries[-1] - boundaries[1]
    busy = asyncio.run(service.busy_seconds())[url] - busy_before
    dropped = producer.counts.samples_dropped if producer is not None else 0
    if producer is not None:
        producer.close()
    step_seconds = statistics.median(b - a for a, b in itertools.pairwise(boundaries[1:]))
    return Result(
        loop,
        max_lag,
        sample,
        learn,
        round(step_seconds, 3),
        round(step_seconds / max(sample, learn), 3),
        round(step_seconds / (sample + learn), 3),
        round(max(0.0, 1 - busy / wall), 3),
        round(1 - learning / wall, 3),
        dropped,
    )


@dataclass
class DemoResult:
    max_lag: int
    steps: int
    timed: StepTime


def run_demo(lags: list[int], steps: int, workdir: Path) -> list[DemoResult]:
    """The demo's RLJob for ``steps`` steps at each of ``lags``, one after another on one local control plane."""
    from kubernetes import client

    from lockstep_e2e.demo import TINY, demo_cluster, step

    results = []
    with demo_cluster(workdir) as (cluster, api):
        for lag in lags:
            namespace = f"bench-lag-{lag}"
            client.CoreV1Api(api).create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace)))
            step(f"maxLag {lag}: the demo's RLJob for {steps} steps")
            run = run_tiny_rl_job(
                cluster,
                api,
                namespace,
                workdir / namespace,
                steps=steps,
                timeout=900.0 + 10.0 * steps,
                progress=step,
                text=True,
                trainer=merged(TINY.trainer, {"maxLag": lag}),
            )
            if run.job["status"]["phase"] != "Succeeded":
                raise SystemExit(f"the maxLag {lag} run did not succeed; pod logs in {workdir / namespace / 'pods'}")
            timed = step_time(run.steps, update_seconds(cluster, namespace, run))
            step(f"maxLag {lag}: {timed.said()}")
            results.append(DemoResult(lag, steps, timed))
    return results


def print_demo(results: list[DemoResult]) -> None:
    print(
        f"{'maxLag':>6} {'step s':>7} {'parts s':>8} {'/max':>6} {'/sum':>6} {'actor idle':>10} {'trainer idle':>12} "
        f"{'stale':>5}"
    )
    for r in results:
        t = r.timed
        print(
            f"{r.max_lag:>6} {t.step:>7.2f} {t.parts:>8.2f} {t.step / t.longest:>6.2f} {t.step / t.parts:>6.2f} "
            f"{1 - t.actor_busy:>10.0%} {1 - t.learning / t.step:>12.0%} {t.stale_samples_dropped:>5}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m lockstep_e2e.bench_pipeline", description=__doc__.splitlines()[0])
    parser.add_argument("--demo", action="store_true", help="the demo's RLJob instead of the stubs")
    parser.add_argument("--steps", type=int, default=None, help="steps a run (stubs: 12; the demo: 20)")
    parser.add_argument("--sample-seconds", type=float, default=0.4, help="one request's generation time")
    parser.add_argument("--learn-seconds", type=float, default=0.4)
    parser.add_argument("--lags", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=None, help="default: out/benchmarks/pipeline[-demo].json")
    options = parser.parse_args()
    benchmarks = REPO / "out" / "benchmarks"
    if options.demo:
        workdir = REPO / "out" / "bench-pipeline-demo"
        if workdir.exists():
            shutil.rmtree(workdir)
        workdir.mkdir(parents=True)
        demo_results = run_demo(options.lags, options.steps or 20, workdir)
        print_demo(demo_results)
        write_results(options.out or benchmarks / "pipeline-demo.json", demo_results)
        return
    steps = options.steps or 12
    actor = SteadyActor(rate=MAX_TOKENS / options.sample_seconds)
    port = free_port()
    serve(actor, port)
    url = f"http://127.0.0.1:{port}"
    results = [
        run(loop, lag, steps, options.sample_seconds, options.learn_seconds, actor, url)
        for lag in options.lags
        for loop in ("before", "after")
    ]
    print(
        f"{'loop':6} {'maxLag':>6} {'step s':>7} {'/max':>6} {'/sum':>6} {'actor idle':>10} {'trainer idle':>12} "
        f"{'stale':>5}"
    )
    for r in results:
        print(
            f"{r.loop:6} {r.max_lag:>6} {r.step_seconds:>7.3f} {r.step_over_max:>6.2f} {r.step_over_sum:>6.2f} "
            f"{r.actor_idle_fraction:>10.0%} {r.trainer_idle_fraction:>12.0%} {r.stale_samples_dropped:>5}"
        )
    write_results(options.out or benchmarks / "pipeline.json", results)


if __name__ == "__main__":
    main()
