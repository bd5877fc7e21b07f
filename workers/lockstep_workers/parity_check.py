"""The parity check: how far the rollout engine's token logprobs are from the trainer's, per vLLM
configuration, from vLLM V1's defaults through each of the four fixes to the locked policy.

For each configuration one vLLM V1 engine (in this process, as the actor runs it) samples three
workloads, and the trainer's forward pass (a Hugging Face model, the same sampler transform)
recomputes the logprob of every sampled token:

- ``batch``: prompts x samples at the given temperature, top-p 1;
- ``sharedPrefix``: an in-flight weight update (pause with the configuration's semantics, reload,
  resume), then a group of requests sharing a long prompt with requests served before it, as GRPO
  groups do; compared with the trainer under the new weights;
- ``topP``: the batch again at top-p < 1; tokens vLLM sampled that fall outside the trainer's top-p
  set (an infinite log-ratio) are counted apart.

A configuration with a LoRA adapter (``lora``, spec.trainer.lora) runs as a LoRA job's actor does: vLLM's LoRA
engine, a random non-zero PEFT adapter published as version 1 and loaded before the workloads (so batch and topP
are sampled under it), and the in-flight update loads a second adapter (version 2). The trainer recomputes with
the same adapters injected by PEFT (lockstep_workers.weights.lora), so what is measured is vLLM's LoRA kernels against
PEFT's forward; ``adapterEffect`` says how far each adapter moved the trainer's logprobs from the base model's.

Metrics per workload (``compare``): mean and max |Δlogprob|, KL(rollout‖trainer) by the k3 estimator,
the fraction of tokens whose ratio π_trainer/π_rollout leaves [1-ε, 1+ε], ESS of those ratios without
and with truncated importance sampling (min(w, C)), and the correlation of token probabilities.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lockstep import environment, keys
from lockstep.api import (
    PREFIX_CACHE_RULE,
    DType,
    LogprobsMode,
    LoraSettings,
    ParityPolicy,
    PauseMode,
    VllmSettings,
    WeightUpdateSemantics,
)
from lockstep.podconfig import PodConfig, load_pod_config
from lockstep.protocol import PreflightResult, Weights, document
from lockstep_workers.actor.vllm_args import UnsupportedSetting
from lockstep_workers.rollout.record import Rollout
from lockstep_workers.trainer.learner import Policy, token_logprobs

logger = logging.getLogger("lockstep.parity")


@dataclass(frozen=True)
class Configuration:
    """One way to run vLLM and the trainer: engine settings, the trainer's head, update semantics."""

    name: str
    vllm: VllmSettings
    fp32_head: bool
    update: WeightUpdateSemantics
    refused: str | None = None
    """Why a ParityPolicy refuses this combination, when it does."""
    lora: LoraSettings | None = None
    """A LoRA job's adapter (spec.trainer.lora): both sides compute with it applied."""

    def dtype(self, model_dir: Path) -> str:
        """The dtype both sides compute in: the engine's, or the checkpoint's when it is auto."""
        if self.vllm.dtype and self.vllm.dtype is not DType.AUTO:
            return self.vllm.dtype.value
        config = _checkpoint_config(model_dir)
        return str(config.get("dtype") or config.get("torch_dtype") or "float32")


def _checkpoint_config(model_dir: Path) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((model_dir / "config.json").read_text())
    return config


@dataclass(frozen=True)
class Workload:
    prompts: int = 8
    samples: int = 4
    tokens: int = 32
    temperature: float = 0.7
    top_p: float = 0.9
    epsilon: float = 0.2
    cap: float = 2.0
    shared_prefix: int = 320
    update_size: float = 0.2
    """How far the in-flight update moves each weight tensor, as a fraction of its spread."""
    adapter_size: float = 0.05
    """With a LoRA adapter: how far each adapted module's update (alpha/r)·B·A is, as a fraction of its weight's
    spread (random_adapter): enough to move the logprobs well beyond the mismatch, as a trained adapter does."""


def configurations(policy: ParityPolicy, engine: VllmSettings) -> list[Configuration]:
    """V1 defaults, each fix added in turn, the locked policy, the incoherent combination the policy
    refuses (prefix caching on with clear_cache=False), the locked policy with both sides in fp32
    (what is left is kernel numerics), and the locked policy with a LoRA adapter (rank 16, the default
    target modules: vLLM's LoRA kernels against PEFT's forward). ``engine`` holds the settings every run shares (dtype,
    max_model_len, memory)."""
    base = engine.model_dump(exclude_none=True)
    defaults = WeightUpdateSemantics(pause_mode=PauseMode.ABORT, clear_cache=True)  # pause_generation()'s own
    kept = WeightUpdateSemantics(pause_mode=PauseMode.KEEP, clear_cache=False)
    steps: list[tuple[str, dict[str, Any], bool, WeightUpdateSemantics]] = [
        ("vLLM V1 defaults", {"logprobs_mode": LogprobsMode.RAW_LOGPROBS}, False, defaults),
        ("+ processed logprobs", {"logprobs_mode": LogprobsMode.PROCESSED_LOGPROBS}, False, defaults),
        (
            "+ explicit runtime defaults",
            {"enable_prefix_caching": False, "async_scheduling": False, "disable_cascade_attn": True},
            False,
            defaults,
        ),
        ("+ pause keep, clear_cache=False", {}, False, kept),
        ("+ fp32 lm_head", {"hf_overrides": {"head_dtype": "float32"}}, True, kept),
    ]
    result, settings = [], dict(base)  # each fix is added on top of the ones before it
    for name, change, fp32_head, update in steps:
        settings = {**settings, **change}
        result.append(Configuration(name, VllmSettings(**settings), fp32_head, update))
    locked = VllmSettings(**{**base, **policy.spec.vllm.model_dump(exclude_none=True)})
    locked_head = policy.spec.trainer.lm_head_dtype is DType.FLOAT32
    name = policy.metadata.get("name", "policy")
    result.append(Configuration(f"locked ({name})", locked, locked_head, policy.spec.weight_update))
    incoherent = locked.model_copy(update={"enable_prefix_caching": True})
    result.append(
        Configuration("locked + prefix caching", incoherent, locked_head, kept, refused=PREFIX_CACHE_RULE["message"])
    )
    fp32 = locked.model_copy(update={"dtype": DType.FLOAT32})
    result.append(Configuration(f"locked ({name}), fp32 model", fp32, True, policy.spec.weight_update))
    lora = LoraSettings()
    result.append(
        Configuration(
            f"locked ({name}) + LoRA r{lora.rank}",
            locked,
            locked_head,
            policy.spec.weight_update,
            lora=lora,
        )
    )
    return result


def compare(rollout: Sequence[float], trainer: Sequence[float], epsilon: float, cap: float) -> dict[str, float]:
    """Mismatch metrics of the same tokens' logprobs (rollout engine vs trainer); -inf trainer logprobs
    (outside its top-p set) are counted in ``outsideTopP`` and left out of the rest."""
    sampled, recomputed = torch.tensor(rollout, dtype=torch.float64), torch.tensor(trainer, dtype=torch.float64)
    finite = recomputed.isfinite()
    sampled, recomputed = sampled[finite], recomputed[finite]
    delta = recomputed - sampled
    ratio = delta.exp()
    truncated = ratio.clamp(max=cap)

    def ess(weights: torch.Tensor) -> float:
        return float(weights.sum() ** 2 / (len(weights) * (weights**2).sum()))

    probabilities = torch.stack([sampled.exp(), recomputed.exp()])
    return {
        "tokens": float(len(finite)),
        "outsideTopP": float((~finite).sum()),
        "meanAbsDiff": float(delta.abs().mean()),
        "maxAbsDiff": float(delta.abs().max()),
        "klK3": float((ratio - 1 - delta).mean()),
        "clipFraction": float(((ratio < 1 - epsilon) | (ratio > 1 + epsilon)).double().mean()),
        "ess": ess(ratio),
        "essTis": ess(truncated),
        "tisTruncatedFraction": float((ratio > cap).double().mean()),
        "probabilityCorrelation": float(torch.corrcoef(probabilities)[0, 1]),
    }


@dataclass
class Measurement:
    configuration: Configuration
    workloads: dict[str, dict[str, float]] = field(default_factory=dict)
    adapter_effect: dict[str, dict[str, float]] = field(default_factory=dict)
    """With a LoRA adapter, per workload: mean and max |Δlogprob| of the trainer with the adapter against the
    trainer with none (the base model), on the same tokens: how much the adapter moves the logprobs."""

    def document(self) -> dict[str, Any]:
        lora = self.configuration.lora
        return {
            "name": self.configuration.name,
            "vllm": self.configuration.vllm.model_dump(mode="json", by_alias=True, exclude_none=True),
            "trainerLmHeadFp32": self.configuration.fp32_head,
            "weightUpdate": self.configuration.update.model_dump(mode="json", by_alias=True),
            "refusedByPolicy": self.configuration.refused,
            "lora": lora.model_dump(mode="json", by_alias=True) if lora is not None else None,
            **self.workloads,
            **({"adapterEffect": self.adapter_effect} if self.adapter_effect else {}),
        }


def perturbed(model_dir: Path, scale: float = 0.05, seed: int = 1) -> dict[str, torch.Tensor]:
    """The model's weights moved by ``scale`` of each tensor's spread: the "new weights" of an update."""
    from safetensors.torch import load_file

    generator = torch.Generator().manual_seed(seed)
    result = {}
    for name, tensor in load_file(str(model_dir / "model.safetensors")).items():
        noise = torch.randn(tensor.shape, generator=generator) * tensor.float().std() * scale
        result[name] = (tensor.float() + noise).to(tensor.dtype)
    return result


def random_adapter(
    model_dir: Path, settings: LoraSettings, scale: float = 0.2, seed: int = 1
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A random non-zero LoRA adapter of the model, as a LoRA job's trainer publishes one: PEFT's config of
    ``settings`` (target modules resolved on the model, lockstep_workers.weights.lora.adapter_config), lora_A and lora_B
    drawn (seeded) so that each adapted module's update (alpha/r)·B·A has ``scale`` of its weight's spread, as
    ``perturbed`` moves full weights. Returns the tensors under PEFT's file names and the header metadata."""
    from transformers import AutoModelForCausalLM

    from lockstep_workers.weights import lora

    causal_lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = lora.adapter_config(settings, causal_lm)
    lora.inject(causal_lm, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in causal_lm.modules():
            module: Any = layer  # a PEFT LoRA layer (untyped)
            if not hasattr(module, "lora_A") or lora.ADAPTER_NAME not in module.lora_A:
                continue
            down, up = module.lora_A[lora.ADAPTER_NAME].weight, module.lora_B[lora.ADAPTER_NAME].weight
            down.copy_(torch.randn(down.shape, generator=generator) / math.sqrt(down.shape[1]))
            up.copy_(torch.randn(up.shape, generator=generator))
            update = module.scaling[lora.ADAPTER_NAME] * (up @ down)
            up.mul_(scale * module.base_layer.weight.float().std() / update.std())
    tensors = {name: p.detach().clone() for name, p in causal_lm.named_parameters() if p.requires_grad}
    return lora.file_names(tensors), lora.adapter_metadata(config)


def random_prompts(count: int, length: int, vocabulary: int, seed: int) -> list[list[int]]:
    """``count`` prompts: <s> (id 1) and ``length`` random non-special tokens."""
    generator = torch.Generator().manual_seed(seed)
    return [[1, *torch.randint(3, vocabulary, (length,), generator=generator).tolist()] for _ in range(count)]


async def _sample(actor: Any, prompts: list[list[int]], samples: int, sampling: dict[str, Any]) -> list[Rollout]:
    async def one(index: int, prompt: list[int], seed: int) -> Rollout:
        body = await actor.generate(prompt, {**sampling, "seed": seed})
        return Rollout(prompt, body["token_ids"], body["logprobs"], index, body["weights_versions"])

    jobs = [one(i, p, i * 1000 + s) for i, p in enumerate(prompts) for s in range(samples)]
    return list(await asyncio.gather(*jobs))


async def _run_engine(
    configuration: Configuration,
    model_dir: Path,
    update: Weights,
    workload: Workload,
    vocabulary: int,
    initial: Weights | None = None,
) -> dict[str, list[Rollout]]:
    """The three workloads' rollouts from one vLLM engine run with ``configuration``; with a LoRA adapter,
    ``initial`` (adapter version 1) is loaded before them and ``update`` is the second adapter."""
    from vllm.v1.engine.async_llm import AsyncLLM

    from lockstep_workers.actor.adapters import LoraEngine
    from lockstep_workers.actor.server import Actor, applied_settings, engine_args
    from lockstep_workers.weights.files import WeightsDirectory, local_path

    lora = LoraEngine(configuration.lora, max_lag=1) if configuration.lora is not None else None
    llm = AsyncLLM.from_engine_args(engine_args(str(model_dir), applied_settings(configuration.vllm), lora=lora))
    actor = Actor(
        llm, pause_mode=configuration.update.pause_mode, clear_cache=configuration.update.clear_cache, lora=lora
    )
    sampling = {"temperature": workload.temperature, "max_tokens": workload.tokens, "ignore_eos": True}

    async def load(weights: Weights) -> None:
        await actor.pause()
        with WeightsDirectory(local_path(weights).parent).read(weights) as verified:
            await actor.load(weights, verified)
        await actor.resume()

    try:
        if initial is not None:
            await load(initial)  # as a LoRA job's actor takes its first adapter
        prompts = random_prompts(workload.prompts, 5, vocabulary, seed=0)
        batch = await _sample(actor, prompts, workload.samples, {**sampling, "top_p": 1.0})
        top_p = await _sample(actor, prompts, workload.samples, {**sampling, "top_p": workload.top_p})
        # The shared prompt and the in-flight request's completion must fit in the engine's context.
        context = configuration.vllm.max_model_len or _checkpoint_config(model_dir).get("max_position_embeddings", 2048)
        length = max(1, min(workload.shared_prefix, context - 4 * workload.tokens - 2))
        [shared] = random_prompts(1, length, vocabulary, seed=1)
        await _sample(actor, [shared], workload.samples, sampling)  # served under the old weights: cached
        in_flight = asyncio.create_task(actor.generate(shared, {**sampling, "max_tokens": 4 * workload.tokens}))
        await asyncio.sleep(0.3)
        await load(update)
        after = await _sample(actor, [shared], workload.samples, sampling)
        await in_flight  # aborted (defaults) or finished under the new weights (keep)
        return {"batch": batch, "topP": top_p, "sharedPrefix": after}
    finally:
        llm.shutdown()


def measure(
    configurations: Sequence[Configuration], model_dir: Path, workdir: Path, workload: Workload
) -> list[Measurement]:
    """Run every configuration; the trainer recomputes each workload's tokens."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from lockstep_workers.weights import lora
    from lockstep_workers.weights.files import local_path, publish

    new_weights = perturbed(model_dir, workload.update_size)
    update = publish(new_weights, workdir / "weights", version=1)
    trainers: dict[tuple[str, str], Any] = {}
    adapters: dict[str, tuple[Weights, Weights]] = {}
    """Per LoRA setting (its JSON): the published adapter versions 1 and 2."""

    def published_adapters(settings: LoraSettings) -> tuple[Weights, Weights]:
        key = settings.model_dump_json()
        if key not in adapters:
            directory = workdir / f"adapters-{len(adapters)}"
            versions = [random_adapter(model_dir, settings, workload.adapter_size, seed=v) for v in (1, 2)]
            adapters[key] = tuple(  # type: ignore[assignment]
                publish(tensors, directory, version=v, metadata=metadata)
                for v, (tensors, metadata) in enumerate(versions, 1)
            )
        return adapters[key]

    def trainer_model(dtype: str, weights: str | Weights, settings: LoraSettings | None = None) -> Any:
        """The trainer's model in ``dtype``: "base", "updated" (the full-weights update), or with the adapter of
        ``settings`` injected as the trainer injects it and loaded from the published version ``weights``."""
        key = (dtype, weights if isinstance(weights, str) else str(local_path(weights)))
        if key not in trainers:
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
            if weights == "updated":
                model.load_state_dict({n: t.to(getattr(torch, dtype)) for n, t in new_weights.items()}, strict=False)
            elif isinstance(weights, Weights):
                assert settings is not None
                lora.inject(model, lora.adapter_config(settings, model))
                tensors = lora.live_names(load_file(str(local_path(weights))))
                missing, unexpected = model.load_state_dict(tensors, strict=False)
                assert not unexpected and not [n for n in missing if "lora_" in n], (missing, unexpected)
            trainers[key] = model.eval()
        return trainers[key]

    def recompute(model: Any, configuration: Configuration, sampled: list[Rollout], top_p: float) -> list[float]:
        with torch.no_grad():
            policy = Policy(model, fp32_head=configuration.fp32_head)
            recomputed, _, _ = token_logprobs(policy, sampled, workload.temperature, top_p=top_p)
        return [v for row, r in enumerate(sampled) for v in recomputed[row, : len(r.completion)].tolist()]

    vocabulary = trainer_model("float32", "base").config.vocab_size
    results = []
    for number, configuration in enumerate(configurations, 1):
        logger.info("[%d/%d] %s: starting vLLM", number, len(configurations), configuration.name)
        first, second = published_adapters(configuration.lora) if configuration.lora is not None else (None, update)
        rollouts = asyncio.run(_run_engine(configuration, model_dir, second, workload, vocabulary, initial=first))
        gc.collect()  # the engine's processes are gone; collect it here, not at interpreter exit
        measurement = Measurement(configuration)
        dtype = configuration.dtype(model_dir)
        for name, sampled in rollouts.items():
            updated = name == "sharedPrefix"
            top_p = workload.top_p if name == "topP" else 1.0
            weights: str | Weights = "updated" if updated else "base"
            if first is not None:
                weights = second if updated else first
            trainer = recompute(trainer_model(dtype, weights, configuration.lora), configuration, sampled, top_p)
            engine = [v for r in sampled for v in r.logprobs]
            measurement.workloads[name] = compare(engine, trainer, workload.epsilon, workload.cap)
            if first is not None:
                base = recompute(trainer_model(dtype, "base"), configuration, sampled, top_p)
                measurement.adapter_effect[name] = _effect(base, trainer)
        logger.info("[%d/%d] %s: %s", number, len(configurations), configuration.name, _summary(measurement))
        results.append(measurement)
    return results


def _effect(base: Sequence[float], adapted: Sequence[float]) -> dict[str, float]:
    """Mean and max |Δlogprob| of the same tokens with and without the adapter, where both are finite (a token
    outside either's top-p set is left out)."""
    without, with_adapter = torch.tensor(base, dtype=torch.float64), torch.tensor(adapted, dtype=torch.float64)
    both = without.isfinite() & with_adapter.isfinite()
    delta = (with_adapter - without)[both].abs()
    return {"meanAbsDiff": float(delta.mean()), "maxAbsDiff": float(delta.max())}


def _summary(measurement: Measurement) -> str:
    batch, shared = measurement.workloads["batch"], measurement.workloads["sharedPrefix"]
    effect = measurement.adapter_effect.get("batch")
    return (
        f"mean |Δlogprob| {batch['meanAbsDiff']:.2e}, clip {batch['clipFraction']:.3f}; after an update with a "
        f"shared prefix {shared['meanAbsDiff']:.2e} (max {shared['maxAbsDiff']:.2f})"
    ) + (
        f"; the adapter moves the trainer's logprobs from the base model's by {effect['meanAbsDiff']:.2e} "
        f"(max {effect['maxAbsDiff']:.2f})"
        if effect
        else ""
    )


COLUMNS = (
    ("configuration", None, None),
    ("mean |Δ|", "batch", "meanAbsDiff"),
    ("max |Δ|", "batch", "maxAbsDiff"),
    ("KL k3", "batch", "klK3"),
    ("clip@ε", "batch", "clipFraction"),
    ("ESS", "batch", "ess"),
    ("ESS TIS", "batch", "essTis"),
    ("w > C", "batch", "tisTruncatedFraction"),
    ("corr p", "batch", "probabilityCorrelation"),
    ("shared prefix after update mean |Δ|", "sharedPrefix", "meanAbsDiff"),
    ("top-p outside ‰", "topP", "outsideTopP"),
)


def table_rows(results: Sequence[Measurement]) -> list[list[str]]:
    rows = []
    for measurement in results:
        row = [measurement.configuration.name + (" (refused)" if measurement.configuration.refused else "")]
        for _, workload, key in COLUMNS[1:]:
            assert workload is not None and key is not None
            values = measurement.workloads[workload]
            value = values[key] * 1000 / max(values["tokens"], 1) if key == "outsideTopP" else values[key]
            row.append(f"{value:.3g}" if not math.isnan(value) else "nan")
        rows.append(row)
    return rows


def plot(results: Sequence[Measurement], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [m.configuration.name for m in results]
    panels = (
        ("batch", "meanAbsDiff", "mean |Δlogprob|, batch", True),
        ("batch", "clipFraction", "tokens outside [1-ε, 1+ε]", False),
        ("sharedPrefix", "meanAbsDiff", "mean |Δlogprob|, shared prefix after an update", True),
    )
    figure, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), constrained_layout=True)
    for axis, (workload, key, title, log) in zip(axes, panels, strict=True):
        axis.barh(names, [max(m.workloads[workload][key], 1e-9) for m in results])
        axis.set_title(title)
        axis.invert_yaxis()
        if log:
            axis.set_xscale("log")
        axis.grid(alpha=0.3, axis="x")
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def write_results(results: Sequence[Measurement], workload: Workload, out: Path, meta: dict[str, Any]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    document = {
        **meta,
        "workload": workload.__dict__,
        "configurations": [m.document() for m in results],
    }
    path = out / "parity.json"
    path.write_text(json.dumps(document, indent=2) + "\n")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """``lockstep parity-check`` (also ``python -m lockstep_workers.parity_check``)."""
    import argparse

    from rich.console import Console
    from rich.table import Table

    from lockstep.parity import default_policy

    parser = argparse.ArgumentParser(prog="lockstep parity-check", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a Hugging Face model directory (default: a tiny random Llama)")
    parser.add_argument("--policy", type=Path, help="the ParityPolicy to check (default: the shipped default)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--out", type=Path, default=Path("out/parity"), help="where parity.json and parity.png go")
    parser.add_argument(
        "--only", action="append", metavar="TEXT", help="run only the configurations whose name contains TEXT"
    )
    parser.add_argument("--head-scale", type=float, default=PEAKY_HEAD_SCALE, help="the tiny model's lm_head factor")
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.15,
        help="vLLM's memory fraction for each engine (on the CPU build: of the machine's memory)",
    )
    defaults = Workload()
    for name, value in defaults.__dict__.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    parser.add_argument(
        "--preflight",
        action="store_true",
        help="in an RLJob's preflight pod: check only the job's effective configuration ($LOCKSTEP_CONFIG) and "
        "write the result on this pod ($POD_NAME) for the operator",
    )
    options = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    workload = Workload(**{name: getattr(options, name) for name in defaults.__dict__})
    if options.preflight:
        return preflight(options.model, workload, os.environ)
    policy = default_policy()
    if options.policy:
        import yaml

        policy = ParityPolicy.model_validate(yaml.safe_load(options.policy.read_text()))
    engine = VllmSettings(
        dtype=DType(options.dtype),
        enforce_eager=True,
        max_model_len=512,
        gpu_memory_utilization=options.gpu_memory_utilization,
    )
    listed = configurations(policy, engine)
    if unmatched := [text for text in options.only or [] if not any(text in c.name for c in listed)]:
        parser.error(f"--only {unmatched}: no configuration's name contains it; they are {[c.name for c in listed]}")
    chosen = [c for c in listed if not options.only or any(text in c.name for text in options.only)]
    model = options.model
    if model is None:
        from lockstep_workers.tiny_model import create_tiny_llama

        model = create_tiny_llama(options.out / "model", dtype=options.dtype, head_scale=options.head_scale)
        logger.info(
            "a tiny random Llama (%s, lm_head x%g for peaky logits) in %s", options.dtype, options.head_scale, model
        )
    results = measure(chosen, model, options.out, workload)
    table = Table(title=f"train-inference mismatch, {model} (temperature {workload.temperature}, ε {workload.epsilon})")
    for title, _, _ in COLUMNS:
        table.add_column(title, justify="left" if title == "configuration" else "right")
    for row in table_rows(results):
        table.add_row(*row)
    Console(width=200).print(table)
    path = write_results(results, workload, options.out, {"model": str(model), "dtype": options.dtype})
    print(f"JSON: {path}\nplot: {plot(results, options.out / 'parity.png')}")
    return 0


def job_configuration(config: PodConfig) -> Configuration:
    """What a job runs, as a Configuration: its vLLM settings, its trainer's head, its weight-update semantics
    and, for a LoRA job (spec.trainer.lora), its adapter's settings, so that the preflight measures vLLM's LoRA
    kernels against PEFT under them."""
    lora = config.training.lora
    return Configuration(
        f"the job's effective configuration (ParityPolicy {config.policy!r})"
        + (f", LoRA r{lora.rank}" if lora is not None else ""),
        config.vllm,
        config.trainer.lm_head_dtype is DType.FLOAT32,
        config.weight_update,
        lora=lora,
    )


def preflight(model: Path, workload: Workload, environ: Mapping[str, str]) -> int:
    """Measure the job's effective configuration and write a PreflightResult on this pod (with the engine
    arguments the settings were applied as); exit 1, naming them, when this vLLM cannot honour the settings or the
    model is of a refused architecture, or a mixture of experts this vLLM cannot run as the job asks
    (lockstep_workers.actor.architectures)."""
    from lockstep_workers.actor.architectures import (
        UnsupportedArchitecture,
        check_architecture,
        moe_engine_args,
        vllm_has_triton,
    )
    from lockstep_workers.actor.server import applied_settings
    from lockstep_workers.agent.pod_agent import pod_api

    config = load_pod_config(environ)
    if config is None:
        raise SystemExit(
            f"--preflight: {environment.CONFIG} is not set; the preflight checks the configuration the operator "
            "mounts in an RLJob's preflight pod: run it there, or run the parity check without --preflight"
        )
    configuration = job_configuration(config)
    try:
        applied = applied_settings(configuration.vllm)
        check_architecture(str(model))
        # What the actors would refuse; the preflight's own engine measures logprobs and needs no routings.
        moe_engine_args(
            str(model),
            lora=config.training.lora is not None,
            routing_replay=config.routing_replay,
            has_triton=vllm_has_triton(),
        )
    except (UnsupportedSetting, UnsupportedArchitecture) as refused:
        raise SystemExit(f"the preflight does not start: {refused}") from None
    with tempfile.TemporaryDirectory() as workdir:
        [measurement] = measure([configuration], model, Path(workdir), workload)
    batch, top = measurement.workloads["batch"], measurement.workloads["topP"]
    result = PreflightResult(
        mean_abs_logprob_diff=batch["meanAbsDiff"],
        shared_prefix_mean_abs_logprob_diff=measurement.workloads["sharedPrefix"]["meanAbsDiff"],
        clip_fraction=batch["clipFraction"],
        outside_top_p_per_thousand=top["outsideTopP"] * 1000 / max(top["tokens"], 1),
        tokens=int(batch["tokens"]),
        engine_args=applied.engine_args,
        satisfied_by_construction=sorted(applied.satisfied_by_construction),
    )
    annotations = {keys.PREFLIGHT: document(result)}
    pod = environ[environment.POD_NAME]
    pod_api().patch_namespaced_pod(pod, environ[environment.POD_NAMESPACE], {"metadata": {"annotations": annotations}})
    logger.info("preflight result written on pod %s: %s", pod, _summary(measurement))
    return 0


PEAKY_HEAD_SCALE = 40.0
"""A random model's logits are flat; scaling its lm_head makes them peaky, as a trained model's are."""


if __name__ == "__main__":
    raise SystemExit(main())
