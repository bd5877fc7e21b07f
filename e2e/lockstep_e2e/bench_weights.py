"""Benchmark: weight updates at real model sizes, on random Llama-shaped state dicts (fp32, made in memory).

``python -m lockstep_e2e.bench_weights [--sizes 0.1 0.5 1.0] [--repeats 3] [--step-seconds 4] [--parts ...]
[--memory-sizes 0.5]`` (``make bench-weights``; the parts: publish, actor, gloo, lora, memory, stream). Each part
measures one share of an update and prints its table; all write out/benchmarks/weights.json.

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

**lora**, LoRA versions (spec.trainer.lora's defaults: rank 16, every linear module of the decoder layers) on the
same base models, over the filesystem transport: the real ``Actor(lora=...)`` (vLLM's LoRA adapters, maxLag
``LORA_MAX_LAG``) while ``GENERATING`` requests keep generating, each on the adapter served when it started. Each of
``repeats`` versions is a random adapter made as the trainer publishes one (``lora_adapter``), updated to by the
barrier as a pod's agent carries it out: stage (read and verify), pause (a no-op), load (``add_lora`` from the
verified copy), resume (new requests take the new adapter). For each: the bytes a version moves against the full
weights', announcement → serving and its parts, the actor's own record (pauseSeconds 0, no pausedAt), tokens/s and
the longest time with no token over the update windows against the idle ones.
**memory**, the trainer's share: one ``learner.learn`` step on the model as ``model.build`` makes it (fp32, sharded
on 1 rank over gloo, Adam over the parameters that train; for LoRA the adapter injected by ``lora.inject``, the base
frozen), full weights and LoRA, each in a fresh process, at ``--memory-sizes``: the peak resident memory
(VmHWM) of the build and of the learn step, and the optimizer state's bytes.

**stream**, the trainer's publish of a mixture of experts at ``--memory-sizes`` (a random Qwen3-MoE, 16 experts a
layer, sharded on 1 rank over gloo), each way in a fresh process: whole (``sharding.full_state_dict``: every layer
gathered, then written) against streamed (``sharding.gathered_layers`` into ``weights.StreamedPublish`` with a
buffer of ``STREAM_BUFFER_BYTES``, smaller than the version): the peak resident memory over the model's, the time
the trainer's thread was held, and the time until the file was in place.

Not a test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
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

from lockstep.api import LoraSettings, Training, WeightSyncBackend
from lockstep.protocol import BarrierPhase, Command, TransferGroup, Weights
from lockstep_e2e.benchmarks import write_results
from lockstep_e2e.cluster import free_port
from lockstep_e2e.install import REPO
from lockstep_workers.actor.adapters import LoraEngine
from lockstep_workers.actor.server import Actor, LoopEngine, applied_settings, engine_args
from lockstep_workers.agent.core import AgentCore, Staged
from lockstep_workers.tiny_model import cpu_vllm_settings, create_tiny_llama
from lockstep_workers.weights import lora
from lockstep_workers.weights.files import (
    Publisher,
    StreamedPublish,
    WeightsDirectory,
    WeightsOrigin,
    digest_of,
    publish,
    version_path,
)
from lockstep_workers.weights.transfer import ManifestServer, Sender, TrainerManifests, manifest_uri

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
    arrived (wall-clock seconds), to count tokens/s over any window. With a LoRA ``actor``, each request takes the
    adapter the actor serves when it starts and keeps it, as ``Actor.generate`` does."""

    def __init__(self, llm: Any, actor: Actor | None = None) -> None:
        self.llm = llm
        self.actor = actor if actor is not None and actor.adapters is not None else None
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
            async with contextlib.AsyncExitStack() as held:
                request = None
                if self.actor is not None:
                    _, request = await held.enter_async_context(self.actor.request_adapter())
                async for output in self.llm.generate(
                    TokensPrompt(prompt_token_ids=PROMPT), params, uuid.uuid4().hex, lora_request=request
                ):
                    now = time.time()
                    self.arrivals.extend([now] * len(output.outputs[0].token_ids))

    def tokens(self, windows: list[tuple[float, float]]) -> float:
        """Tokens per second over ``windows`` (start, end) together."""
        count = sum(start < arrival <= end for start, end in windows for arrival in self.arrivals)
        return count / sum(end - start for start, end in windows)

    def longest_gap(self, windows: list[tuple[float, float]]) -> float:
        """The longest time with no token arriving inside any of ``windows`` (its ends count as arrivals): the
        longest stall of generation there."""
        gaps = []
        for start, end in windows:
            times = [start, *sorted(a for a in self.arrivals if start < a <= end), end]
            gaps.append(max(later - earlier for earlier, later in itertools.pairwise(times)))
        return max(gaps)

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
        """A LoRA update never pauses (pausedAt None, pauseSeconds 0): its pause is 0."""
        paused = update["pausedAt"] is not None
        pause_called = update["pausedAt"] - update["pauseSeconds"] if paused else update["resumedAt"]
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
    load_check_s: float
    """The re-tie and the load check after that reload (lockstep_workers.actor.load_check), which every swap
    includes."""
    before: UpdateTimes
    """Staged inside the pause (the agent before issue 22's staging)."""
    after: UpdateTimes
    """Staged while generating (AgentCore and LoopEngine, as in a pod)."""
    tokens_per_s_idle: float
    tokens_per_s_staging: float
    """Over every staging window together (after)."""
    tokens_per_s_before_staging: float
    """Over the before runs' staging windows (inside their pause)."""
    tokens_per_s_updating: float
    """Over every update window (after): from the announcement until resume_generation returned."""
    longest_gap_idle_s: float
    """The longest time with no token arriving in the idle windows."""
    longest_gap_updating_s: float
    """The same over the update windows (after): the stall as generation sees it (the pause, at least)."""

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
    floors, reads, reloads, checks = [], [], [], []
    staging: list[tuple[float, float]] = []
    updating: list[tuple[float, float]] = []
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
                    updating.append((announced, float(actor.updates[-1]["resumedAt"] or 0.0)))
                    # The floor and vLLM's reload from memory, as the swap would run: paused, the copy staged.
                    with await asyncio.to_thread(files.read, published) as verified:
                        await llm.pause_generation(mode="keep", clear_cache=False)
                        floors.append(copy_floor(state))
                        [timed] = await llm.collective_rpc("lockstep_timed_reload", args=(verified.path,))
                        await llm.resume_generation()
                    reads.append(timed["read"])
                    reloads.append(timed["reload"])
                    checks.append(timed["check"])
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
            load_check_s=_median(checks),
            before=_median_times(before),
            after=_median_times(after),
            tokens_per_s_idle=round(generation.tokens(idle), 1),
            tokens_per_s_staging=round(generation.tokens(staging), 1),
            tokens_per_s_before_staging=round(generation.tokens(before_staging), 1),
            tokens_per_s_updating=round(generation.tokens(updating), 1),
            longest_gap_idle_s=_median([generation.longest_gap(idle)]),
            longest_gap_updating_s=_median([generation.longest_gap(updating)]),
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
        f" + reload from memory {result.vllm_reload_from_memory_s:.3f} s + load check {result.load_check_s:.3f} s"
        f" | before: {_times(result.before)}"
        f" | after: {_times(result.after)} | tokens/s idle {result.tokens_per_s_idle}, staging"
        f" {result.tokens_per_s_staging}, staging inside the pause {result.tokens_per_s_before_staging}, updating"
        f" {result.tokens_per_s_updating} | longest gap idle {result.longest_gap_idle_s:.3f} s, updating"
        f" {result.longest_gap_updating_s:.3f} s"
        f" | {result.ratios}",
        flush=True,
    )
    return result


LORA_MAX_LAG = 1
"""The LoRA actor's maxLag (vLLM holds maxLag + 2 adapters): older adapters go once their requests end, as in a job."""


def full_bytes(gigabytes: float) -> int:
    """The bytes of ``llama_state_dict(gigabytes)`` (what a full-weights version moves), without making it."""
    shape = llama_shape(gigabytes)
    hidden, intermediate = shape.hidden, shape.intermediate
    layer = 4 * hidden * hidden + 3 * hidden * intermediate + 2 * hidden
    return 4 * (2 * VOCABULARY * hidden + shape.layers * layer + hidden)


def lora_adapter(model_dir: Path, settings: LoraSettings, seed: int) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A random adapter of the model at ``model_dir`` as the trainer publishes one: the trainer's PEFT config
    (``lora.adapter_config``: with no targetModules, every linear module of the decoder layers), injected into the
    model (on the meta device: only the names and shapes), its trainable tensors under PEFT's file names, random
    (lora_B too, so it changes what the actor samples), and the header metadata."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        causal_lm = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    config = lora.adapter_config(settings, causal_lm)
    lora.inject(causal_lm, config)
    generator = torch.Generator().manual_seed(seed)
    trainable = {name: p.shape for name, p in causal_lm.named_parameters() if p.requires_grad}
    tensors = {name: torch.randn(*shape, generator=generator) / 64 for name, shape in trainable.items()}
    return lora.file_names(tensors), lora.adapter_metadata(config)


@dataclass
class LoraResult:
    """LoRA versions on the actor's base model of each size, generation running (the module's docstring)."""

    gigabytes: float
    """The base model's fp32 state dict (what a full-weights version moves)."""
    rank: int
    target_modules: list[str]
    repeats: int
    generating: int
    adapter_bytes: int
    """The adapter's tensors (fp32), what a LoRA version moves."""
    adapter_file_bytes: int
    """The published file, header included."""
    full_bytes: int
    update: UpdateTimes
    """Medians: stage (read and verify), swap = load (write the adapter's directory, add_lora), resume."""
    recorded_pause_s: float
    """The largest pauseSeconds in the actor's own update records (0: no pause)."""
    recorded_paused: bool
    """Whether any update record has a pausedAt."""
    tokens_per_s_idle: float
    tokens_per_s_updating: float
    """Over every update window: from the announcement until the actor serves the new adapter."""
    longest_gap_idle_s: float
    longest_gap_updating_s: float
    served_adapters: list[int]
    """The adapter versions vLLM held at the end (maxLag + 1 at most once the old ones' requests have ended)."""


def lora_part(sizes: list[float], repeats: int, step_seconds: float, scratch: Path) -> list[LoraResult]:
    """The actor's share of LoRA versions, over the filesystem transport (the module's docstring)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return [asyncio.run(_lora_size(target, repeats, scratch)) for target in sizes]


async def _lora_size(target: float, repeats: int, scratch: Path) -> LoraResult:
    from vllm.v1.engine.async_llm import AsyncLLM

    settings = LoraSettings()
    engine_lora = LoraEngine(settings, LORA_MAX_LAG)
    model_dir = served_model(target, scratch / f"lora-model-{target}")
    directory = (scratch / f"lora-{target}").resolve()
    llm = AsyncLLM.from_engine_args(
        engine_args(str(model_dir), applied_settings(cpu_vllm_settings()), lora=engine_lora)
    )
    actor = Actor(llm, lora=engine_lora)
    files = WeightsDirectory(directory)
    core = AgentCore(LoopEngine(actor, asyncio.get_running_loop(), files))
    generation = Generation(llm, actor)
    idle: list[tuple[float, float]] = []
    updating: list[tuple[float, float]] = []
    updates: list[UpdateTimes] = []
    adapter_bytes = file_bytes = 0
    modules: list[str] = []
    try:
        for version in range(1, repeats + 1):
            tensors, metadata = lora_adapter(model_dir, settings, seed=version)
            adapter_bytes = size_of(tensors)
            modules = json.loads(metadata[lora.ADAPTER_CONFIG_METADATA])["target_modules"]
            weights = await asyncio.to_thread(publish, tensors, directory, version, metadata=metadata)
            file_bytes = version_path(directory, version).stat().st_size
            started = time.time()
            await asyncio.sleep(IDLE_SECONDS)
            idle.append((started, time.time()))
            announced = time.time()
            await asyncio.to_thread(barrier, core, weights, None, (*UPDATE, BarrierPhase.RESUME))
            if actor.serving != version:
                raise RuntimeError(f"the actor serves version {actor.serving} after the update to {version}")
            updates.append(UpdateTimes.of(actor.updates[-1], announced))
            updating.append((announced, float(actor.updates[-1]["resumedAt"] or 0.0)))
        await asyncio.sleep(IDLE_SECONDS)  # new requests run on the newest adapter
        result = LoraResult(
            gigabytes=round(full_bytes(target) / 1e9, 2),
            rank=settings.rank,
            target_modules=modules,
            repeats=repeats,
            generating=GENERATING,
            adapter_bytes=adapter_bytes,
            adapter_file_bytes=file_bytes,
            full_bytes=full_bytes(target),
            update=_median_times(updates),
            recorded_pause_s=max(float(u["pauseSeconds"] or 0.0) for u in actor.updates),
            recorded_paused=any(u["pausedAt"] is not None for u in actor.updates),
            tokens_per_s_idle=round(generation.tokens(idle), 1),
            tokens_per_s_updating=round(generation.tokens(updating), 1),
            longest_gap_idle_s=_median([generation.longest_gap(idle)]),
            longest_gap_updating_s=_median([generation.longest_gap(updating)]),
            served_adapters=sorted(await llm.list_loras()),
        )
    finally:
        await generation.stop()
        llm.shutdown()
        shutil.rmtree(directory, ignore_errors=True)
        shutil.rmtree(model_dir, ignore_errors=True)
    print(
        f"lora r{result.rank}, {result.gigabytes:5.2f} GB base: adapter {result.adapter_bytes / 1e6:.1f} MB"
        f" ({result.adapter_bytes / result.full_bytes:.2%} of the full weights) | announced→serving"
        f" {result.update.announced_to_serving_s:.3f} s (stage {result.update.stage_s:.3f} s, add_lora"
        f" {result.update.swap_s:.3f} s, resume {result.update.resuming_s:.3f} s), recorded pause"
        f" {result.recorded_pause_s} s | tokens/s idle {result.tokens_per_s_idle}, updating"
        f" {result.tokens_per_s_updating} | longest gap idle {result.longest_gap_idle_s:.3f} s, updating"
        f" {result.longest_gap_updating_s:.3f} s",
        flush=True,
    )
    return result


MEMORY_BATCH = (4, 2, 16, 48)
"""The learn step's synthetic batch: prompts, completions per prompt, prompt and completion tokens."""


@dataclass
class TrainerMemory:
    """One learn step of the trainer's model of one size, full or LoRA, in a fresh process (the docstring)."""

    gigabytes: float
    lora: bool
    parameters: int
    trainable_parameters: int
    optimizer_state_bytes: int
    """Every tensor in the Adam optimizer's state after the step (exp_avg, exp_avg_sq, step)."""
    rss_after_build_gb: float
    """Resident memory once the model is loaded, sharded, and its optimizer made."""
    peak_rss_build_gb: float
    """The process's peak resident memory (VmHWM) until then: loading the checkpoint included."""
    peak_rss_learn_gb: float
    """Its peak over the learn step alone (VmHWM reset after the build)."""
    learn_s: float


def memory_part(
    sizes: list[float], repeats: int, step_seconds: float, scratch: Path, modes: Sequence[bool] = (False, True)
) -> list[TrainerMemory]:
    """The trainer's peak memory in one learn step, full weights against LoRA, each in a fresh process; ``modes``:
    which of them (with LoRA: True), both by default."""
    import multiprocessing

    results = []
    context = multiprocessing.get_context("spawn")
    for target in sizes:
        model_dir = served_model(target, scratch / f"memory-model-{target}")
        try:
            for with_lora in modes:
                queue = context.SimpleQueue()
                process = context.Process(target=_learn_once, args=(str(model_dir), with_lora, queue))
                process.start()
                process.join()
                if process.exitcode != 0 or queue.empty():
                    raise RuntimeError(f"the learn step's process failed (exit {process.exitcode})")
                result = TrainerMemory(gigabytes=round(full_bytes(target) / 1e9, 2), **queue.get())
                results.append(result)
                print(
                    f"trainer, {result.gigabytes:5.2f} GB, {'LoRA' if result.lora else 'full'}: trainable"
                    f" {result.trainable_parameters / 1e6:.2f}M of {result.parameters / 1e6:.1f}M, optimizer state"
                    f" {result.optimizer_state_bytes / 1e6:.1f} MB | RSS after build {result.rss_after_build_gb:.2f}"
                    f" GB (peak {result.peak_rss_build_gb:.2f}), peak in the learn step"
                    f" {result.peak_rss_learn_gb:.2f} GB ({result.learn_s:.1f} s)",
                    flush=True,
                )
        finally:
            shutil.rmtree(model_dir, ignore_errors=True)
    return results


def _memory_kb(field: str) -> int:
    """A field of /proc/self/status in kB (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _learn_once(model_dir: str, with_lora: bool, results: Any) -> None:
    """In a fresh process: build the trainer's model as the trainer does (``trainer.model.build``: fp32, the adapter
    injected for LoRA, sharded on 1 rank over gloo, Adam over the parameters that train), run one ``learn`` step on a
    synthetic batch, and put what it used on ``results``."""
    import random

    import torch.distributed as dist

    from lockstep_workers.rollout.record import Rollout
    from lockstep_workers.trainer import model as trainer_model
    from lockstep_workers.trainer import sharding
    from lockstep_workers.trainer.learner import learn

    device = torch.device("cpu")
    mesh = sharding.start(0, 1, device)
    settings = Training(reward="lockstep_workers.rewards:target_words", lora=LoraSettings() if with_lora else None)
    model = trainer_model.build(model_dir, settings, None, mesh)
    rss_after_build, peak_build = _memory_kb("VmRSS"), _memory_kb("VmHWM")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    prompts, group, prompt_tokens, completion_tokens = MEMORY_BATCH
    words = random.Random(0)
    vocab = model.causal_lm.config.vocab_size
    batch = [
        Rollout(
            [words.randrange(3, vocab) for _ in range(prompt_tokens)],
            [words.randrange(3, vocab) for _ in range(completion_tokens)],
            [-5.0] * completion_tokens,
            index,
            [0] * completion_tokens,
        )
        for index in range(prompts)
        for _ in range(group)
    ]
    started = time.monotonic()
    learn(model.policy, model.optimizer, batch, [(n % 3) / 2 for n in range(len(batch))], settings.objective, 1.0)
    learn_s = time.monotonic() - started
    state = [t for s in model.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    results.put(
        {
            "lora": with_lora,
            "parameters": sum(p.numel() for p in model.causal_lm.parameters()),
            "trainable_parameters": sum(p.numel() for p in model.causal_lm.parameters() if p.requires_grad),
            "optimizer_state_bytes": sum(t.numel() * t.element_size() for t in state),
            "rss_after_build_gb": round(rss_after_build * 1024 / 1e9, 2),
            "peak_rss_build_gb": round(peak_build * 1024 / 1e9, 2),
            "peak_rss_learn_gb": round(_memory_kb("VmHWM") * 1024 / 1e9, 2),
            "learn_s": round(learn_s, 2),
        }
    )
    dist.destroy_process_group()


STREAM_BUFFER_BYTES = 64 << 20
"""The streamed publish's buffer in the stream part: well under one version, so that it streams."""


@dataclass
class PublishMemory:
    """One publish of a random mixture of experts of one size, whole or streamed, in a fresh process (the docstring)."""

    gigabytes: float
    streamed: bool
    layers: int
    peak_over_model_gb: float
    """The process's peak resident memory (VmHWM) during the publish, over its resident memory before it (the model
    sharded on one rank)."""
    blocked_s: float
    """How long the trainer's thread was held: the gather, and (streamed) its waits for the writer."""
    written_s: float
    """From the publish's start until the version's file was renamed into place."""


def moe_config(gigabytes: float) -> Any:
    """A Qwen3-MoE config of about ``gigabytes`` of fp32 weights: 16 experts (top 2) of 512 per layer, hidden 1024."""
    from transformers import Qwen3MoeConfig

    per_layer = 16 * 3 * 1024 * 512 + 4 * 1024 * 1024  # experts, attention
    layers = max(1, round(gigabytes * 1e9 / 4 / per_layer))
    return Qwen3MoeConfig(
        vocab_size=VOCABULARY,
        hidden_size=1024,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=4,
        num_experts=16,
        num_experts_per_tok=2,
        moe_intermediate_size=512,
        intermediate_size=2048,
    )


def stream_part(sizes: list[float], repeats: int, step_seconds: float, scratch: Path) -> list[PublishMemory]:
    """The trainer's publish of a mixture of experts, whole (``sharding.full_state_dict``, then ``weights.publish``)
    against streamed (``sharding.gathered_layers`` into ``weights.StreamedPublish`` with a STREAM_BUFFER_BYTES
    buffer), each in a fresh process: the peak memory over the model's, and the times."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    results = []
    for target in sizes:
        for streamed in (False, True):
            queue = context.SimpleQueue()
            process = context.Process(target=_publish_once, args=(target, streamed, str(scratch), queue))
            process.start()
            process.join()
            if process.exitcode != 0 or queue.empty():
                raise RuntimeError(f"the publish's process failed (exit {process.exitcode})")
            result = PublishMemory(**queue.get())
            results.append(result)
            print(
                f"publish of a mixture of experts, {result.gigabytes:5.2f} GB in {result.layers} layers,"
                f" {'streamed' if result.streamed else 'whole'}: peak {result.peak_over_model_gb:.2f} GB over the"
                f" model's, trainer held {result.blocked_s:.2f} s, written in {result.written_s:.2f} s",
                flush=True,
            )
    return results


def _publish_once(gigabytes: float, streamed: bool, scratch: str, results: Any) -> None:
    """In a fresh process: a random mixture of experts of ``gigabytes`` sharded on 1 rank over gloo, published once
    as the trainer publishes it (streamed or whole); put what it cost on ``results``."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from lockstep_workers.trainer import sharding

    mesh = sharding.start(0, 1, torch.device("cpu"))
    causal_lm = AutoModelForCausalLM.from_config(moe_config(gigabytes), dtype=torch.float32)
    sharding.shard(causal_lm, mesh, compute_dtype=torch.float32, fp32_head=True)
    bytes_ = sum(p.numel() * p.element_size() for p in causal_lm.parameters())
    directory = Path(scratch) / f"stream-{gigabytes}-{streamed}"
    before = _memory_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    started = time.monotonic()
    if streamed:
        writing = StreamedPublish(sharding.checkpoint_layout(causal_lm), directory, 1, 3, limit=STREAM_BUFFER_BYTES)
        for layer in sharding.gathered_layers(causal_lm):
            writing.put(layer)
        writing.close()
        blocked = time.monotonic() - started
        writing.result()
    else:
        whole = sharding.full_state_dict(causal_lm)
        blocked = time.monotonic() - started
        publish(whole, directory, 1)
    written = time.monotonic() - started
    results.put(
        {
            "gigabytes": round(bytes_ / 1e9, 2),
            "streamed": streamed,
            "layers": causal_lm.config.num_hidden_layers,
            "peak_over_model_gb": round((_memory_kb("VmHWM") - before) * 1024 / 1e9, 2),
            "blocked_s": round(blocked, 2),
            "written_s": round(written, 2),
        }
    )
    shutil.rmtree(directory, ignore_errors=True)
    dist.destroy_process_group()


PARTS: dict[str, Callable[[list[float], int, float, Path], Sequence[object]]] = {
    "publish": publish_part,
    "actor": actor_part,
    "gloo": gloo_part,
    "lora": lora_part,
    "memory": memory_part,
    "stream": stream_part,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--sizes", type=float, nargs="+", default=[0.1, 0.5, 1.0], help="state dict sizes in GB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--step-seconds", type=float, default=4.0, help="the learning step's stand-in")
    parser.add_argument("--parts", nargs="+", choices=sorted(PARTS), default=sorted(PARTS))
    parser.add_argument(
        "--memory-sizes", type=float, nargs="+", default=[0.5], help="the memory and stream parts' model sizes in GB"
    )
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
            sizes = options.memory_sizes if part in ("memory", "stream") else options.sizes
            results.extend(PARTS[part](sizes, options.repeats, options.step_seconds, scratch))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    write_results(options.out, results)


if __name__ == "__main__":
    main()
