"""The trainer's step on this machine: ``learn`` on a model sharded with FSDP2 (lockstep_workers.trainer.sharding), on
``--ranks`` processes (NCCL on a GPU, gloo on CPUs), with synthetic rollouts. Prints one JSON line and writes it to
``--out``: tokens/s, peak accelerator memory, MFU, the fp32 head's logprob gap to an fp32 reference, and the
backend and device of every collective the step and its metrics ran.

``python e2e/gpu/bench.py --model tiny --ranks 2`` (the demo's model and batch, CPU), or, on one CUDA GPU,
``python e2e/gpu/bench.py --model llama-0.5b`` (what e2e/gpu/check.sh runs).

MFU counts the model FLOPs a step needs over its time, against the bf16 dense peak: per token, 2·N (the no-grad
pass that gives the old logprobs) + 6·N (forward and backward) for the N non-embedding body parameters, the same
for the head at completion tokens only, and causal attention (1 + 3)·2·layers·length·hidden; the head's
recomputation in the backward pass is not counted, as activation recomputation never is, nor is the KL reference's
forward pass (``--kl-reference``): compare its tokens/s.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import spawn

from lockstep.api import Objective, RolloutCorrection
from lockstep_workers.rollout.record import Rollout
from lockstep_workers.trainer import sharding
from lockstep_workers.trainer.learner import Policy, across_ranks, learn, token_logprobs

BF16_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}
"""Dense bf16 peaks by GPU name (NVIDIA's data sheets, without sparsity)."""

MODELS: dict[str, dict[str, Any]] = {
    "tiny": {"vocab_size": 256, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2},
    "llama-0.5b": {"vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24},
}
"""``tiny``: the demo's model (lockstep_workers.tiny_model); ``llama-0.5b``: a random Llama of 0.44B parameters
with a 32k vocabulary (about the size of the issue's reference measurement)."""


def build(name: str) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = MODELS[name]
    heads = shape["hidden_size"] // 64
    config = LlamaConfig(
        **shape,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).float()


def rollouts(step: int, prompts: int, group: int, prompt_tokens: int, completion_tokens: int, vocab: int) -> list[Any]:
    words = random.Random(step)
    batch = []
    for index in range(prompts):
        prompt = [words.randrange(3, vocab) for _ in range(prompt_tokens)]
        for _ in range(group):
            completion = [words.randrange(3, vocab) for _ in range(completion_tokens)]
            batch.append(Rollout(prompt, completion, [-5.0] * completion_tokens, index, [step - 1] * completion_tokens))
    return batch


def model_flops(model: Any, sequences: int, prompt_tokens: int, completion_tokens: int) -> float:
    config = model.config
    head = config.vocab_size * config.hidden_size
    body = sum(p.numel() for p in model.parameters()) - head - model.model.embed_tokens.weight.numel()
    length = prompt_tokens + completion_tokens
    attention = 4 * 2 * config.num_hidden_layers * length * config.hidden_size
    per_sequence = length * (8 * body + attention) + completion_tokens * 8 * head
    return float(sequences * per_sequence)


def collectives_seen(log: list[dict[str, str]]) -> None:
    """Record the backend and tensor device of every all_reduce from here on."""
    original = dist.all_reduce

    def recording(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        group = kwargs.get("group") or (args[1] if len(args) > 1 else None)
        log.append({"backend": str(dist.get_backend(group)), "device": str(tensor.device)})
        return original(tensor, *args, **kwargs)

    dist.all_reduce = recording


def logprob_gap(model: Any, policy: Policy, batch: list[Any], device: torch.device) -> dict[str, float]:
    """Mean and max |Δlogprob| of the sharded policy (layers in bf16, head as configured) against the same weights
    computing wholly in fp32."""
    reference = build_like(model, device)
    with torch.no_grad():
        ours, _, mask = token_logprobs(policy, batch, 1.0)
        exact, _, _ = token_logprobs(Policy(reference, fp32_head=True), batch, 1.0)
    gap = (ours - exact).abs()[mask.bool()]
    return {"mean_abs_logprob_gap": gap.mean().item(), "max_abs_logprob_gap": gap.max().item()}


def build_like(model: Any, device: torch.device) -> Any:
    """An fp32 copy of the sharded ``model``'s current weights on ``device`` (rank 0 only: single-rank runs)."""
    copy = type(model)(model.config).float().to(device)
    copy.load_state_dict(sharding.full_state_dict(model))
    return copy


def print_profile(step: Any, device: torch.device, rank: int) -> None:
    """Run ``step`` under torch's profiler and print, on rank 0, the 25 operators that took the most time of their own
    (CPU time on a CPU), with their shapes."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as profiler:
        step()
        if cuda:
            torch.cuda.synchronize()
    if rank == 0:
        averages = profiler.key_averages(group_by_input_shape=True)
        print(
            averages.table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=25), flush=True
        )


def rank_main(rank: int, world: int, port: int, options: argparse.Namespace, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if options.threads:
        torch.set_num_threads(options.threads)
    device = sharding.accelerator(rank)
    mesh = sharding.start(rank, world, device)
    seen: list[dict[str, str]] = []
    collectives_seen(seen)
    model = build(options.model)
    dtype = getattr(torch, options.dtype)
    policy = sharding.shard(
        model, mesh, compute_dtype=dtype, fp32_head=options.head == "float32", activation_checkpointing=options.ac
    )
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-5, fused=device.type == "cuda")
    reference = None
    if options.kl_reference != "none":  # a full fine-tuning job's KL reference, as the trainer builds it
        frozen = build(options.model).requires_grad_(False)
        offload = options.kl_reference == "host"
        reference = sharding.shard(
            frozen, mesh, compute_dtype=dtype, fp32_head=options.head == "float32", offload=offload
        )
    objective = Objective(
        algorithm="grpo",
        minibatches=options.minibatches,
        tokens_per_micro_batch=options.micro_batch_tokens,
        rollout_correction=RolloutCorrection(upper=2.0),
        kl_coefficient=0.05 if reference is not None else 0.0,
    )
    vocab = model.config.vocab_size

    def learn_step(step: int) -> dict[str, float]:
        batch = rollouts(step, options.prompts, options.group, options.prompt_tokens, options.completion_tokens, vocab)
        mine = [r for r in batch if r.group % world == rank]
        rewards = [(n % 3) / 2 for n in range(len(mine))]
        metrics = learn(policy, optimizer, mine, rewards, objective, 1.0, version=step - 1, reference=reference)
        return across_ranks(metrics, device)

    times = []
    for step in range(1, options.steps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        metrics = learn_step(step)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step > options.warmup:
            times.append(time.perf_counter() - started)
    if options.profile:  # one more step, untimed
        print_profile(lambda: learn_step(options.steps + 1), device, rank)
    result: dict[str, Any] = {}
    if rank == 0:
        sequences = options.prompts * options.group
        tokens = sequences * (options.prompt_tokens + options.completion_tokens)
        seconds = statistics.median(times)
        result = {
            "model": options.model,
            "parameters": sum(p.numel() for p in model.parameters()),
            "ranks": world,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "dtype": options.dtype,
            "head": options.head,
            "kl_reference": options.kl_reference,
            "tokens_per_step": tokens,
            "median_step_seconds": round(seconds, 4),
            "tokens_per_second": round(tokens / seconds),
            "loss": metrics["loss"],
            "collectives": sorted({(c["backend"], c["device"]) for c in seen}),
        }
        if device.type == "cuda":
            name = torch.cuda.get_device_name(device)
            peak = next((v for k, v in BF16_PEAK_TFLOPS.items() if k in name), options.peak_tflops)
            flops = model_flops(model, sequences, options.prompt_tokens, options.completion_tokens)
            result["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
            result["bf16_peak_tflops"] = peak
            result["mfu"] = round(flops / seconds / (peak * 1e12), 4) if peak else None
    if options.gap and world == 1:
        probe = rollouts(0, 4, 2, options.prompt_tokens, options.completion_tokens, vocab)
        result.update(logprob_gap(model, policy, probe, device))
    if rank == 0:
        results.put(result)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the timing")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8, help="completions per prompt")
    parser.add_argument("--prompt-tokens", type=int, default=4)
    parser.add_argument("--completion-tokens", type=int, default=8)
    parser.add_argument("--minibatches", type=int, default=2)
    parser.add_argument("--micro-batch-tokens", type=int, default=None)
    parser.add_argument("--dtype", default="float32", help="the layers' compute dtype")
    parser.add_argument("--head", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--ac", action="store_true", help="activation checkpointing")
    parser.add_argument(
        "--kl-reference",
        choices=("none", "device", "host"),
        default="none",
        help="a KL term to a frozen copy of the model, on the accelerator or offloaded to host memory",
    )
    parser.add_argument("--gap", action="store_true", help="also measure the logprob gap to an fp32 reference")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (CPU)")
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="bf16 peak of a GPU not in the table")
    parser.add_argument(
        "--profile", action="store_true", help="print the operators of one more step that took the most time"
    )
    parser.add_argument("--out", type=Path)
    options = parser.parse_args()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    results = mp.get_context("spawn").SimpleQueue()
    spawn(rank_main, args=(options.ranks, port, options, results), nprocs=options.ranks)
    result = results.get()
    line = json.dumps(result)
    print(line, flush=True)
    if options.out:
        with options.out.open("a") as stream:
            stream.write(line + "\n")


if __name__ == "__main__":
    main()
