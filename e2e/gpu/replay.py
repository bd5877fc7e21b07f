"""Routing replay's engine half (issue 44) on one CUDA GPU with vLLM's CUDA build: a tiny random Qwen3-MoE
(lockstep_workers.tiny_models), served by vLLM as the actor serves a replaying job (``actor.engine_args`` on the
default policy's locked settings in fp32, with what routing replay adds: prefix caching, and from
``architectures.moe_engine_args`` enable_return_routed_experts), samples a few groups of completions through
``Actor.generate`` (processed logprobs, and each request's routed experts as the actor returns them); then the
trainer's code (lockstep_workers.trainer.routing, ``learner.token_logprobs`` with the fp32 head) recomputes their
logprobs without and with replaying the engine's routings. Prints one JSON line and appends it to ``--out``:
routing_mismatch (the fraction of (token, MoE layer) pairs where the trainer's own top-k set differs from the
engine's, in its own forward; routing_mismatch_replaying: in the replaying forward, as ``learn`` measures it), the
mean and max |Δlogprob| to the engine's without and with replay, the tokens compared, and the shapes vLLM returned:
its routed experts' layer axis against the model's layers and MoE layers (``layer_axis``), and its rows per sample
against the sample's tokens.

``python e2e/gpu/replay.py --out FILE`` (every layer an MoE layer), ``--dense-layer 0`` (layer 0 a dense MLP:
whether vLLM's layer axis counts all layers or only the MoE ones). What e2e/gpu/replay_check.sh runs. Exits 2,
saying why in one line, where this machine cannot run it (no vLLM, vLLM's CPU build, no CUDA GPU).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lockstep_workers.rollout.record import Rollout
from lockstep_workers.tiny_models import VOCABULARY, create_tiny_model, family
from lockstep_workers.trainer import routing
from lockstep_workers.trainer.learner import Policy, attention_mask, device_of, token_logprobs

PROMPT_TOKENS = 40
"""Two full KV blocks of 16 and a part: the later samples of a group find them in the prefix cache, so their
routings of those tokens come from vLLM's store of cached routings, not from a forward pass."""
TEMPERATURE = 1.0
SAMPLING = {"max_tokens": 24, "temperature": TEMPERATURE, "ignore_eos": True}
ALL_LAYERS, MOE_LAYERS = "all layers", "MoE layers"
EVERY_LAYER_MOE = "every layer is an MoE layer (all layers and MoE layers agree)"


def engine_refusal() -> str | None:
    """Why this machine cannot run vLLM's half of routing replay, in words; None when it can."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return "vLLM is not installed: routing replay's engine check needs vLLM's CUDA build (pip install vllm)"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible to torch: routing replay's engine check needs one"
    if not current_platform.is_cuda():
        return (
            f"this vLLM is built for {current_platform.device_type!r}, not CUDA: vLLM returns routed experts only "
            "from its Model Runner V2, which needs Triton (the CUDA build); install vLLM's CUDA build"
        )
    return None


def tiny_moe(directory: Path, dense_layer: int | None, dtype: str) -> Path:
    """The tiny random Qwen3-MoE of tiny_models in ``directory``, with decoder layer ``dense_layer`` a dense MLP
    (Qwen3-MoE's mlp_only_layers) where given."""
    moe = family("qwen3-moe")
    if dense_layer is not None:
        moe = dataclasses.replace(moe, fields={**moe.fields, "mlp_only_layers": [dense_layer]})
    return create_tiny_model(moe, directory, dtype=dtype)


def layer_axis(engine_layers: int, layers: int, moe: Sequence[int]) -> str:
    """What the layer axis of vLLM's routed experts ([tokens, ``engine_layers``, top_k]) counts, on a model of
    ``layers`` decoder layers whose MoE layers are ``moe``: ALL_LAYERS, MOE_LAYERS, or EVERY_LAYER_MOE where the
    model cannot tell them apart. Raises ValueError when it is neither."""
    if engine_layers == layers == len(moe):
        return EVERY_LAYER_MOE
    if engine_layers == layers:
        return ALL_LAYERS
    if engine_layers == len(moe):
        return MOE_LAYERS
    raise ValueError(
        f"vLLM's routed experts have {engine_layers} layers; the model has {layers} layers, {len(moe)} of them MoE "
        "layers: the layer axis is neither"
    )


def shapes(
    samples: Sequence[tuple[list[int], list[int], torch.Tensor]], layers: int, moe: Sequence[int]
) -> dict[str, Any]:
    """The shapes of the engine's routed experts of ``samples`` (prompt, completion, experts [rows, layers, top_k]):
    per token ([layers, top_k]), their rows less the sample's tokens (prompt and completion), and the layer axis
    (``layer_axis``) on a model of ``layers`` layers with the MoE layers ``moe``. Raises ValueError when the samples
    differ in shape per token or the layer axis is neither."""
    per_token = sorted({tuple(experts.shape[1:]) for _, _, experts in samples})
    if len(per_token) != 1:
        raise ValueError(f"the samples' routed experts differ in shape per token: {per_token}")
    ((engine_layers, top_k),) = per_token
    return {
        "routed_experts_per_token": [engine_layers, top_k],
        "rows_minus_tokens": sorted({len(e) - len(p) - len(c) for p, c, e in samples}),
        "model_layers": layers,
        "moe_layers": list(moe),
        "layer_axis": layer_axis(engine_layers, layers, moe),
    }


def trainer_pass(
    policy: Policy, rollouts: Sequence[Rollout], temperature: float, *, replay: bool
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """The trainer's logprobs of ``rollouts``' completion tokens and their mask (``token_logprobs``), and the
    routing metrics of that forward (``routing.routing_metrics``), replaying the rollouts' routed_experts or not."""
    moe = routing.routers(policy.causal_lm)
    attention = attention_mask(rollouts)
    engine = routing.engine_routing([r.routed_experts for r in rollouts], attention.shape[1], device_of(policy))
    with torch.no_grad(), routing.routed(moe, engine, replay=replay) as record:
        logprobs, _, mask = token_logprobs(policy, rollouts, temperature)
    statistics = routing.routing_statistics(moe, record, attention.flatten().bool(), engine)
    return logprobs, mask, routing.routing_metrics(statistics)


def measure(policy: Policy, rollouts: Sequence[Rollout], temperature: float) -> dict[str, Any]:
    """The trainer's half of the report: the tokens compared, routing_mismatch in the trainer's own forward and in
    the replaying one (null where no token had an engine routing), and the mean and max |Δlogprob| of the trainer's
    logprobs to the rollouts' (the engine's) without and with replay."""
    report: dict[str, Any] = {}
    for name, replay in (("without_replay", False), ("with_replay", True)):
        logprobs, mask, metrics = trainer_pass(policy, rollouts, temperature, replay=replay)
        engine = torch.zeros_like(logprobs)
        for row, rollout in enumerate(rollouts):
            engine[row, : len(rollout.logprobs)] = torch.tensor(rollout.logprobs)
        gap = (logprobs - engine).abs()[mask.bool()]
        report["tokens"] = int(mask.sum())
        report["routing_mismatch_replaying" if replay else "routing_mismatch"] = metrics.get(routing.ROUTING_MISMATCH)
        report[f"mean_abs_logprob_gap_{name}"] = gap.mean().item()
        report[f"max_abs_logprob_gap_{name}"] = gap.max().item()
    return report


async def sample(model: Path, dtype: str, prompts: int, group: int) -> list[tuple[list[int], dict[str, Any]]]:
    """``group`` completions of each of ``prompts`` random prompts, from an engine started as the actor starts a
    replaying job's, through ``Actor.generate``: each prompt's first alone, then the rest of its group at once
    (which find its prefix in the cache)."""
    from vllm.v1.engine.async_llm import AsyncLLM

    from lockstep.api import VllmSettings
    from lockstep.parity import REPLAY_VLLM, settings_dict
    from lockstep_workers.actor.architectures import moe_engine_args, vllm_has_triton
    from lockstep_workers.actor.server import Actor, applied_settings, engine_args
    from lockstep_workers.tiny_model import cpu_vllm_settings

    settings = VllmSettings.model_validate(settings_dict(cpu_vllm_settings()) | REPLAY_VLLM | {"dtype": dtype})
    applied = applied_settings(settings)
    replay = moe_engine_args(str(model), lora=False, routing_replay=True, has_triton=vllm_has_triton())
    applied = dataclasses.replace(applied, engine_args=applied.engine_args | replay)
    llm = AsyncLLM.from_engine_args(engine_args(str(model), applied))
    actor = Actor(llm, clear_cache=True)
    words = random.Random(0)
    samples = []
    try:
        for _ in range(prompts):
            prompt = [words.randrange(3, VOCABULARY) for _ in range(PROMPT_TOKENS)]
            first = await actor.generate(prompt, SAMPLING)
            rest = await asyncio.gather(*(actor.generate(prompt, SAMPLING) for _ in range(group - 1)))
            samples += [(prompt, out) for out in (first, *rest)]
    finally:
        llm.shutdown()
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--dense-layer", type=int, default=None, help="make this decoder layer a dense MLP")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the engine's dtype")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=4, help="completions per prompt")
    parser.add_argument("--out", type=Path)
    options = parser.parse_args()
    refusal = engine_refusal()
    if refusal is not None:
        print(f"routing replay's engine check does not run: {refusal}", file=sys.stderr)
        sys.exit(2)
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as directory:
        model = tiny_moe(Path(directory), options.dense_layer, options.dtype)
        samples = asyncio.run(sample(model, options.dtype, options.prompts, options.group))
        causal_lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, device_map="cuda").eval()
    missing = sum(out["routed_experts"] is None for _, out in samples)
    if missing:
        sys.exit(
            f"routing replay's engine check failed: {missing} of {len(samples)} samples came without routed experts"
        )
    moe = routing.moe_layers(causal_lm)
    experts = [(prompt, out["token_ids"], torch.tensor(out["routed_experts"])) for prompt, out in samples]
    seen = shapes(experts, causal_lm.config.num_hidden_layers, moe)
    rollouts = [
        Rollout(
            prompt,
            completion,
            out["logprobs"],
            n // options.group,
            routed_experts=routing.over_moe_layers(e, causal_lm),
        )
        for n, ((prompt, completion, e), (_, out)) in enumerate(zip(experts, samples, strict=True))
    ]
    import vllm

    report = {
        "model": "qwen3-moe" + ("" if options.dense_layer is None else f", layer {options.dense_layer} dense"),
        "dtype": options.dtype,
        "device": torch.cuda.get_device_name(),
        "vllm": vllm.__version__,
        "samples": len(samples),
        **measure(Policy(causal_lm, fp32_head=True), rollouts, TEMPERATURE),
        **seen,
    }
    line = json.dumps(report)
    print(line, flush=True)
    if options.out:
        with options.out.open("a") as stream:
            stream.write(line + "\n")


if __name__ == "__main__":
    main()
