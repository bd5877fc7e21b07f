"""Benchmark: weight updates at real model sizes, on random Llama-shaped state dicts (fp32, made in memory).

``python -m lockstep_e2e.bench_weights [--sizes 0.1 0.5 1.0] [--repeats 3] [--step-seconds 4] [--parts publish]``
(``make bench-weights``). Each part measures one share of an update and prints its table; all write
out/benchmarks/weights.json.

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

Not a test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from lockstep_e2e.benchmarks import write_results
from lockstep_e2e.install import REPO
from lockstep_workers.weights import Publisher, digest_of, publish, version_path

VOCABULARY = 16384


def llama_state_dict(gigabytes: float, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random Llama-shaped state dict (fp32, untied head, Hugging Face names) of about ``gigabytes`` GB: hidden
    size 512 below 0.3 GB, else 1024; an MLP 8/3 as wide; as many layers as the size leaves room for."""
    hidden = 512 if gigabytes < 0.3 else 1024
    intermediate = (8 * hidden // 3 + 255) // 256 * 256
    layer_parameters = 4 * hidden * hidden + 3 * hidden * intermediate + 2 * hidden
    layers = max(1, round((gigabytes * 1e9 / 4 - 2 * VOCABULARY * hidden) / layer_parameters))
    generator = torch.Generator().manual_seed(seed)

    def random(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    tensors = {"model.embed_tokens.weight": random(VOCABULARY, hidden)}
    for n in range(layers):
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


PARTS = {"publish": publish_part}


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
