"""Benchmark: weight updates at real model sizes, on random Llama-shaped state dicts (fp32, made in memory).

``python -m lockstep_e2e.bench_weights [--sizes 0.1 0.5 1.0] [--repeats 3] [--step-seconds 4] [--parts ...]``
(``make bench-weights``; the parts: publish, actor, gloo). Each part measures one share of an update and prints its
table; all write out/benchmarks/weights.json.

**publish**, the trainer's share: each of ``repeats`` steps computes for ``step-seconds`` (matrix products, the
stand-in for a learning step), then gathers the weights (the stand-in: a copy of the state dict, which is what
``sharding.full_state_dict`` costs on one CPU rank) and publishes them as the next version.
- before: the inline publish the trainer did up to issue 22 (``save_file`` to a hidden name, rename, then read the
  file back to hash it): the trainer is blocked for the gather and all of that;
- after: ``weights.Publisher`` (write and hash in one pass, fsync, rename, fsync the directory, in the background):
  the trainer is blocked for the gather and any wait for the previous publish.
For each: the trainer's blocked time per publish, the time from the step's end until the version could be
announced, and (after) the background publish's own time and the step's compute rate while it ran, against a step
with no publish. Medians over the repeats.

**actor**, an actor's share over the filesystem transport: the real ``Actor`` (vLLM V1 on the CPU, the locked
settings in fp32) serves a random Llama of each size (``llama_shape``) while ``GENERATING`` requests keep
generating. Each repeat publishes two versions and updates the actor to each (once each at ``ONCE_FROM_GIGABYTES``
and above):
- after: the barrier as a pod's agent carries it out (``AgentCore`` over ``LoopEngine``: Update stages the version
  while vLLM generates, then pauses and swaps; Resume resumes);
- before: the same calls in the order the agent made them up to issue 22's staging (pause, read and verify, swap,
  resume).
**gloo**, the same over gloo: trainer rank 0 (``transfer.Sender`` under an ``AgentCore`` of its own, and its
``ManifestServer``) runs in this process. Staging is fetching and checking the transfer's manifest; the receive is
the swap, inside the pause.
For each: announcement → serving, the pause (from the call to pause_generation until resume_generation returns)
and its parts. Beside them, while generation is paused, the floor (an in-memory copy of the version's bytes) and
vLLM's own reload from tensors its worker already holds (``bench_reloader``); and tokens/s over the staging
windows against tokens/s over the idle windows before each update.

Not a test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from lockstep.api import WeightSyncBackend
from lockstep.protocol import BarrierPhase, Command, TransferGroup, Weights
from lockstep_e2e.benchmarks import write_results
from lockstep_e2e.cluster import free_port
from lockstep_e2e.install import REPO
from lockstep_workers.actor import Actor, LoopEngine, applied_settings, engine_args
from lockstep_workers.agent import AgentCore, Staged
from lockstep_workers.tiny_model import cpu_vllm_settings, create_tiny_llama
from lockstep_workers.transfer import ManifestServer, Sender, TrainerManifests, manifest_uri
from lockstep_workers.weights import Publisher, WeightsDirectory, WeightsOrigin, digest_of, publish, version_path

VOCABULARY = 16384


@dataclass(frozen=True)
class LlamaShape:
    hidden: int
    intermediate: int
    layers: int


def llama_shape(gigabytes: float) -> LlamaShape:
    """A Llama of about ``gigabytes`` GB in fp32 (untied head): hidden size 512 below 0.3 GB, else 1024; an MLP
    8/3 as wide; as many layers as the size leaves room for."""
    hidden = 512 if gigabytes < 0.3 else 1024
    intermediate = (8 * hidden // 3 + 255) // 256 * 256
    layer_parameters = 4 * hidden * hidden + 3 * hidden * intermediate + 2 * hidden
    layers = max(1, round((gigabytes * 1e9 / 4 - 2 * VOCABULARY * hidden) / layer_parameters))
    return LlamaShape(hidden, intermediate, layers)


def llama_state_dict(gigabytes: float, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random state dict (fp32, Hugging Face names) of ``llama_shape(gigabytes)``."""
    shape = llama_shape(gigabytes)
    hidden, intermediate = shape.hidden, shape.intermediate
    generator = torch.Generator().manual_seed(seed)

    def random(*dimensions: int) -> torch.Tensor:
        return torch.randn(*dimensions, generator=generator)

    tensors = {"model.embed_tokens.weight": random(VOCABULARY, hidden)}
    for n in range(shape.layers):
        prefix = f"model.layers.{n}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            tensors[f"{prefix}self_attn.{name}.weight"] = random(hidden, hidden)
        tensors[f"{prefix}mlp.gate_proj.weight"] = random(intermediate, hidden)
        tensors[f"{prefix}mlp.up_proj.weight"] = random(intermediate, hidden)
        tensors[f"{prefix}mlp.down_proj.weight"] = random(hidden, intermediate)
        tensors[f"{prefix}input_layernorm.weight"] = torch.ones(hidden)
        tensors[f"{prefix}post_attention_layernorm.weight"] = torch.ones(hidden)
    tensors["model.norm.weight"] = torch.ones(hidden)
    tensors["lm_head.weight"] = random(VOCABULARY, hidden)
    return tensors


def size_of(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def gather(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The gather's stand-in: a copy, as ``sharding.full_state_dict`` makes of one CPU rank's live parameters."""
    return {name: tensor.clone() for name, tensor in tensors.items()}


def inline_publish(tensors: dict[str, torch.Tensor], directory: Path, version: int) -> str:
    """The trainer's publish before issue 22: write with safetensors, rename, read the file back to hash it."""
    final = version_path(directory, version)
    partial = final.with_name(f".{final.name}.partial")
    save_file(tensors, str(partial))
    os.replace(partial, final)
    return digest_of(final)


def compute(seconds: float) -> float:
    """The learning step's stand-in: matrix products for ``seconds``; returns the products per second."""
    a = torch.randn(512, 512)
    done, started = 0, time.monotonic()
    while time.monotonic() - started < seconds:
        a = torch.tanh(a @ a)
        done += 1
    return done / (time.monotonic() - started)


@dataclass
class PublishResult:
    gigabytes: float
    repeats: int
    step_seconds: float
    gather_s: float
    """The after loop's: its blocked time is this and the wait."""
    before_blocked_s: float
    """Also when the version could be announced, after the step's end."""
    after_blocked_s: float
    after_wait_s: float
    after_announced_s: float
    after_background_s: float
    compute_rate_while_publishing: float
    """The step's compute rate while the background publish ran, over its rate with no publish."""


def publish_part(sizes: list[float], repeats: int, step_seconds: float, scratch: Path) -> list[PublishResult]:
    results = []
    for target in sizes:
        model = llama_state_dict(target)
        gigabytes = round(size_of(model) / 1e9, 2)
        directory = scratch / f"publish-{target}"
        before_blocked, idle_rates = [], []
        for version in range(1, repeats + 1):
            idle_rates.append(compute(step_seconds))
            started = time.monotonic()
            whole = gather(model)
            directory.mkdir(parents=True, exist_ok=True)
            inline_publish(whole, directory, version)
            before_blocked.append(time.monotonic() - started)
            del whole
        shutil.rmtree(directory)

        publisher = Publisher()
        gathers, blocked, waits, busy_rates = [], [], [], []
        announced: dict[int, float] = {}
        background: dict[int, float] = {}
        for version in range(1, repeats + 1):
            busy_rates.append(compute(step_seconds))
            started = time.monotonic()
            whole = gather(model)
            gathers.append(time.monotonic() - started)
            waits.append(publisher.wait())
            blocked.append(time.monotonic() - started)
            publisher.start(version, _timed(whole, directory, version, started, announced, background))
            del whole
        publisher.wait()
        shutil.rmtree(directory)
        result = PublishResult(
            gigabytes=gigabytes,
            repeats=repeats,
            step_seconds=step_seconds,
            gather_s=_median(gathers),
            before_blocked_s=_median(before_blocked),
            after_blocked_s=_median(blocked),
            after_wait_s=_median(waits),
            after_announced_s=_median(list(announced.values())),
            after_background_s=_median(list(background.values())),
            # the first step ran with no publish in flight
            compute_rate_while_publishing=round(statistics.median(busy_rates[1:]) / statistics.median(idle_rates), 2),
        )
        results.append(result)
        print(
            f"{gigabytes:5.2f} GB: gather {result.gather_s:6.2f} s | before: blocked {result.before_blocked_s:6.2f} s"
            f" (announced then) | after: blocked {result.after_blocked_s:6.2f} s (waiting {result.after_wait_s:.2f} s),"
            " announced"
            f" {result.after_announced_s:6.2f} s after the step, background {result.after_background_s:6.2f} s,"
            f" compute {result.compute_rate_while_publishing:.0%} of its rate",
            flush=True,
        )
        del model
    return results


def _timed(
    whole: dict[str, torch.Tensor],
    directory: Path,
    version: int,
    step_ended: float,
    announced: dict[int, float],
    background: dict[int, float],
) -> Callable[[], None]:
    """The background publish of ``version``, recording when it could be announced (after the step's end) and how
    long it took."""

    def work() -> None:
        started = time.monotonic()
        publish(whole, directory, version)
        finished = time.monotonic()
        background[version] = finished - started
        announced[version] = finished - step_ended

    return work


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 3)


def _median_times(updates: list[UpdateTimes]) -> UpdateTimes:
    """Each field's median over ``updates``."""
    return UpdateTimes(**{name: _median([getattr(u, name) for u in updates]) for name in vars(updates[0])})


def _times(update: UpdateTimes) -> str:
    return (
        f"announced→serving {update.announced_to_serving_s:.3f} s, pause {update.pause_s:.3f} s (stage"
        f" {update.stage_s:.3f} s, swap {update.swap_s:.3f} s, pausing {update.pausing_s:.3f} s, resuming"
        f" {update.resuming_s:.3f} s)"
    )


IDLE_SECONDS = 3.0
"""How long generation runs with no update before each one: the rate to compare with."""
GENERATING = 4
"""Requests kept generating on the actor throughout."""
PROMPT = [1, 10, 11, 12, 13]


class Generation:
    """``GENERATING`` requests kept running on ``llm`` (each replaced when it ends); records when every token
    arrived (wall-clock seconds), to count tokens/s over any window."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.arrivals: list[float] = []
        self._tasks = [asyncio.create_task(self._keep(n)) for n in range(GENERATING)]

    async def _keep(self, seed: int) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            temperature=0.7, max_tokens=500, ignore_eos=True, seed=seed, output_kind=RequestOutputKind.DELTA
        )
        while True:
            async for output in self.llm.generate(TokensPrompt(prompt_token_ids=PROMPT), params, uuid.uuid4().hex):
                now = time.time()
                self.arrivals.extend([now] * len(output.outputs[0].token_ids))

    def tokens(self, windows: list[tuple[float, float]]) -> float:
        """Tokens per second over ``windows`` (start, end) together."""
        count = sum(start < arrival <= end for start, end in windows for arrival in self.arrivals)
        return count / sum(end - start for start, end in windows)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class TimedEngine:
    """The actor's agent Engine (LoopEngine), recording when each staging began and ended."""

    def __init__(self, engine: LoopEngine) -> None:
        self.engine = engine
        self.staging: list[tuple[float, float]] = []

    def pause(self) -> None:
        self.engine.pause()

    def stage(self, weights: Weights, group: TransferGroup | None) -> Staged:
        started = time.time()
        staged = self.engine.stage(weights, group)
        self.staging.append((started, time.time()))
        return staged

    def swap(self, staged: Staged) -> None:
        self.engine.swap(staged)

    def resume(self) -> None:
        self.engine.resume()


def served_model(gigabytes: float, directory: Path) -> Path:
    """A model directory (config, random weights, a tokenizer) of ``llama_shape(gigabytes)``: the actor serves it,
    then loads the state dicts ``llama_state_dict`` makes of that size."""
    shape = llama_shape(gigabytes)
    return create_tiny_llama(
        directory,
        vocab_size=VOCABULARY,
        hidden_size=shape.hidden,
        layers=shape.layers,
        intermediate_size=shape.intermediate,
    )


def barrier(core: AgentCore, weights: Weights, group: TransferGroup | None, phases: tuple[BarrierPhase, ...]) -> None:
    """The barrier's ``phases`` as a member's agent sees them: Update (stage, pause, swap; ``group``, the member's
    ranks in the transfer group, if any), then Resume."""
    for phase in phases:
        command = Command(
            id=f"bench/{weights.version}",
            phase=phase,
            group=group if phase is BarrierPhase.UPDATE else None,
            version=weights.version,
            uri=weights.uri,
            digest=weights.digest,
        )
        if (error := core.handle(command).error) is not None:
            raise RuntimeError(f"the agent failed {phase.value}: {error}")


def staged_inside_the_pause(engine: TimedEngine, weights: Weights, group: TransferGroup | None) -> None:
    """What the agent did before issue 22's staging: pause, then read and verify the file (or fetch and check the
    transfer's manifest), swap, resume."""
    engine.pause()
    with contextlib.closing(engine.stage(weights, group)) as staged:
        engine.swap(staged)
    engine.resume()


UPDATE = (BarrierPhase.UPDATE,)


def copy_floor(tensors: dict[str, torch.Tensor], copies: int = 3) -> float:
    """Seconds to copy every tensor into one preallocated (and written, so no page is faulted in) beside it: the
    floor of a swap of these bytes. The median of ``copies``."""
    targets = {name: torch.empty_like(tensor).fill_(0) for name, tensor in tensors.items()}
    seconds = []
    for _ in range(copies):
        started = time.monotonic()
        for name, tensor in tensors.items():
            targets[name].copy_(tensor)
        seconds.append(time.monotonic() - started)
    return statistics.median(seconds)


@dataclass
class UpdateTimes:
    """One update, as the actor recorded it (Actor.updates) and the engine's staging window."""

    announced_to_serving_s: float
    """From the announcement until resume_generation returned."""
    pause_s: float
    """Generation stalled: from the call to pause_generation until resume_generation returned."""
    stage_s: float
    """Read, hash and copy into memory (VerifiedWeights.seconds): before the pause, or inside it (before)."""
    swap_s: float
    """collective_rpc("lockstep_reload"): vLLM's workers read the copy and reload it."""
    pausing_s: float
    resuming_s: float

    @classmethod
    def of(cls, update: dict[str, Any], announced: float) -> UpdateTimes:
        pause_called = update["pausedAt"] - update["pauseSeconds"]
        return cls(
            announced_to_serving_s=update["resumedAt"] - announced,
            pause_s=update["resumedAt"] - pause_called,
            stage_s=update["stageSeconds"],
            swap_s=update["loadSeconds"],
            pausing_s=update["pauseSeconds"],
            resuming_s=update["resumeSeconds"],
        )


@dataclass
class ActorResult:
    transport: str
    gigabytes: float
    repeats: int
    generating: int
    copy_floor_s: float
    """An in-memory copy of the version's bytes, while generation was paused (the median of 3 each time)."""
    vllm_read_s: float
    """vLLM's workers reading the staged copy into tensors (TimedReloader.lockstep_timed_reload), paused."""
    vllm_reload_from_memory_s: float
    """vLLM's reload_weights from tensors its worker already held, paused."""
    before: UpdateTimes
    """Staged inside the pause (the agent before issue 22's staging)."""
    after: UpdateTimes
    """Staged while generating (AgentCore and LoopEngine, as in a pod)."""
    tokens_per_s_idle: float
    tokens_per_s_staging: float
    """Over every staging window together (after)."""
    tokens_per_s_before_staging: float
    """Over the before runs' staging windows (inside their pause)."""

    @property
    def ratios(self) -> str:
        return (
            f"pause/floor {self.after.pause_s / self.copy_floor_s:.2f}x,"
            f" pause/reload-from-memory {self.after.pause_s / self.vllm_reload_from_memory_s:.2f}x,"
            f" generation while staging {self.tokens_per_s_staging / self.tokens_per_s_idle:.0%}"
        )


ONCE_FROM_GIGABYTES = 0.75
"""The actor part updates a model this large or larger once each way (its memory and minutes on this machine)."""


def actor_part(sizes: list[float], repeats: int, step_seconds: float, scratch: Path) -> list[ActorResult]:
    """The actor's share over the filesystem transport (the module's docstring)."""
    return _actor_sizes(sizes, repeats, scratch, WeightSyncBackend.FILESYSTEM)


def gloo_part(sizes: list[float], repeats: int, step_seconds: float, scratch: Path) -> list[ActorResult]:
    """The actor's share over gloo, trainer rank 0 (``transfer.Sender``) in this process (the module's docstring)."""
    return _actor_sizes(sizes, repeats, scratch, WeightSyncBackend.GLOO)


def _actor_sizes(sizes: list[float], repeats: int, scratch: Path, backend: WeightSyncBackend) -> list[ActorResult]:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return [
        asyncio.run(_actor_size(target, 1 if target >= ONCE_FROM_GIGABYTES else repeats, scratch, backend))
        for target in sizes
    ]


async def _actor_size(target: float, repeats: int, scratch: Path, backend: WeightSyncBackend) -> ActorResult:
    from vllm.v1.engine.async_llm import AsyncLLM

    model_dir = served_model(target, scratch / f"model-{target}")
    directory = (scratch / f"{backend.value}-{target}").resolve()
    args = engine_args(str(model_dir), applied_settings(cpu_vllm_settings()), backend)
    args.worker_extension_cls = "lockstep_e2e.bench_reloader.TimedReloader"
    llm = AsyncLLM.from_engine_args(args)
    actor = Actor(llm, backend=backend)
    files = WeightsDirectory(directory)
    origin: WeightsOrigin = files
    group = trainer = manifests = None
    if backend.collective:
        http_port, rendezvous = free_port(), f"127.0.0.1:{free_port()}"
        manifests = ManifestServer(directory, http_port, rendezvous)
        origin = TrainerManifests("127.0.0.1", http_port)
        trainer = AgentCore(Sender(directory, rendezvous, backend))
        group = TransferGroup(rank_offset=1, world_size=2)
    engine = TimedEngine(LoopEngine(actor, asyncio.get_running_loop(), origin))
    core = AgentCore(engine)
    generation = Generation(llm)
    idle: list[tuple[float, float]] = []
    before: list[UpdateTimes] = []
    after: list[UpdateTimes] = []
    floors, reads, reloads = [], [], []
    staging: list[tuple[float, float]] = []
    before_staging: list[tuple[float, float]] = []
    gigabytes, version = 0.0, 0
    try:
        for _ in range(repeats):
            for staged_first in (True, False):
                version += 1
                state = llama_state_dict(target, seed=version)
                gigabytes = round(size_of(state) / 1e9, 2)
                published = await asyncio.to_thread(publish, state, directory, version)
                weights = published
                if isinstance(origin, TrainerManifests):
                    weights = published.model_copy(update={"uri": manifest_uri(origin.host, origin.port, version)})
                started = time.time()
                await asyncio.sleep(IDLE_SECONDS)
                idle.append((started, time.time()))
                announced = time.time()
                sending = None
                if trainer is not None:  # trainer rank 0 stages (checks its file) and sends when the actor receives
                    sending = asyncio.create_task(
                        asyncio.to_thread(barrier, trainer, weights, TransferGroup(rank_offset=0, world_size=2), UPDATE)
                    )
                if staged_first:
                    await asyncio.to_thread(barrier, core, weights, group, (*UPDATE, BarrierPhase.RESUME))
                else:
                    await asyncio.to_thread(staged_inside_the_pause, engine, weights, group)
                    core.loaded = weights
                if sending is not None:
                    await sending
                if staged_first:
                    after.append(UpdateTimes.of(actor.updates[-1], announced))
                    staging.append(engine.staging[-1])
                    # The floor and vLLM's reload from memory, as the swap would run: paused, the copy staged.
                    with await asyncio.to_thread(files.read, published) as verified:
                        await llm.pause_generation(mode="keep", clear_cache=False)
                        floors.append(copy_floor(state))
                        [timed] = await llm.collective_rpc("lockstep_timed_reload", args=(verified.path,))
                        await llm.resume_generation()
                    reads.append(timed["read"])
                    reloads.append(timed["reload"])
                else:
                    before.append(UpdateTimes.of(actor.updates[-1], announced))
                    before_staging.append(engine.staging[-1])
                del state
        result = ActorResult(
            transport=backend.value,
            gigabytes=gigabytes,
            repeats=repeats,
            generating=GENERATING,
            copy_floor_s=_median(floors),
            vllm_read_s=_median(reads),
            vllm_reload_from_memory_s=_median(reloads),
            before=_median_times(before),
            after=_median_times(after),
            tokens_per_s_idle=round(generation.tokens(idle), 1),
            tokens_per_s_staging=round(generation.tokens(staging), 1),
            tokens_per_s_before_staging=round(generation.tokens(before_staging), 1),
        )
    finally:
        await generation.stop()
        llm.shutdown()
        if manifests is not None:
            manifests.close()
        shutil.rmtree(directory, ignore_errors=True)
        shutil.rmtree(model_dir, ignore_errors=True)
    print(
        f"{result.transport}, {result.gigabytes:5.2f} GB: floor {result.copy_floor_s:.3f} s,"
        f" vLLM read {result.vllm_read_s:.3f} s"
        f" + reload from memory {result.vllm_reload_from_memory_s:.3f} s | before: {_times(result.before)}"
        f" | after: {_times(result.after)} | tokens/s idle {result.tokens_per_s_idle}, staging"
        f" {result.tokens_per_s_staging}, staging inside the pause {result.tokens_per_s_before_staging}"
        f" | {result.ratios}",
        flush=True,
    )
    return result


PARTS: dict[str, Callable[[list[float], int, float, Path], Sequence[object]]] = {
    "publish": publish_part,
    "actor": actor_part,
    "gloo": gloo_part,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--sizes", type=float, nargs="+", default=[0.1, 0.5, 1.0], help="state dict sizes in GB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--step-seconds", type=float, default=4.0, help="the learning step's stand-in")
    parser.add_argument("--parts", nargs="+", choices=sorted(PARTS), default=sorted(PARTS))
    parser.add_argument("--out", type=Path, default=REPO / "out" / "benchmarks" / "weights.json")
    options = parser.parse_args()
    if options.repeats < 2:
        parser.error("--repeats must be at least 2: the first step runs with no publish in flight")
    options.out.parent.mkdir(parents=True, exist_ok=True)
    # Beside the results, on disk (not a tmpfs), as the job's volume would be.
    scratch = Path(tempfile.mkdtemp(prefix="scratch-weights-", dir=options.out.parent))
    results: list[object] = []
    try:
        for part in options.parts:
            results.extend(PARTS[part](options.sizes, options.repeats, options.step_seconds, scratch))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    write_results(options.out, results)


if __name__ == "__main__":
    main()
