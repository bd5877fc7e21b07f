"""The trainer's learning step: token logprobs with the lm_head in fp32, group-normalised advantages,
the objective of lockstep_workers.objective, one optimiser step, and the weights to publish.

What drives it (rollouts from the actors, rewards, announcing weights on the pod) is the trainer
loop; this module is the part that learns, and a test shows a tiny model learning with it.
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from lockstep.api import Objective
from lockstep_workers.objective import Batch, policy_loss

RewardFunction = Callable[[list[int], list[int]], float]
"""reward(prompt token ids, completion token ids) -> a scalar reward."""


def load_reward(reference: str) -> RewardFunction:
    """The reward callable named ``package.module:function`` (RLJob spec.trainer.args.reward)."""
    module, _, name = reference.partition(":")
    if not name:
        raise ValueError(f"reward {reference!r}: expected 'package.module:function'")
    function: RewardFunction = getattr(importlib.import_module(module), name)
    return function


@dataclass(frozen=True)
class Rollout:
    """One sampled completion, with the rollout engine's processed logprob of each token."""

    prompt: list[int]
    completion: list[int]
    logprobs: list[float]
    group: int  # completions of the same prompt share a group (GRPO/GSPO advantages)


async def collect_rollouts(
    actors: Sequence[str], prompts: Sequence[list[int]], group: int, sampling: dict[str, Any]
) -> list[Rollout]:
    """``group`` completions of every prompt from the actors' /generate (spread over them), with the
    processed logprob of each sampled token as the rollout engine computed it."""
    import aiohttp

    requests = [(index, prompt) for index, prompt in enumerate(prompts) for _ in range(group)]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:

        async def one(position: int, index: int, prompt: list[int]) -> Rollout:
            url = f"{actors[position % len(actors)]}/generate"
            async with session.post(url, json={"prompt_token_ids": prompt, "sampling": sampling}) as response:
                response.raise_for_status()
                body = await response.json()
            return Rollout(list(prompt), body["token_ids"], body["logprobs"], index)

        return list(await asyncio.gather(*(one(n, i, p) for n, (i, p) in enumerate(requests))))


def token_logprobs(
    model: Any, rollouts: Sequence[Rollout], temperature: float, *, fp32_head: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logprobs of each completion token under ``model`` (a Hugging Face causal LM; the sampler's
    temperature applied), their entropies and the completion mask, all [sequences, longest completion].
    The final projection runs in fp32 when ``fp32_head`` (the ParityPolicy's trainer.lmHeadDtype), as
    the rollout engine's does."""
    longest = max(len(r.prompt) + len(r.completion) for r in rollouts)
    widest = max(len(r.completion) for r in rollouts)
    ids = torch.zeros(len(rollouts), longest, dtype=torch.long)
    attention = torch.zeros_like(ids)
    for row, r in enumerate(rollouts):
        sequence = r.prompt + r.completion
        ids[row, : len(sequence)] = torch.tensor(sequence)
        attention[row, : len(sequence)] = 1
    hidden = model.model(input_ids=ids, attention_mask=attention).last_hidden_state
    head = model.lm_head.weight
    logits = F.linear(hidden.float(), head.float()) if fp32_head else model.lm_head(hidden).float()
    logits = logits / temperature
    logprobs = torch.zeros(len(rollouts), widest)
    entropy = torch.zeros(len(rollouts), widest)
    mask = torch.zeros(len(rollouts), widest)
    for row, r in enumerate(rollouts):
        start, count = len(r.prompt) - 1, len(r.completion)
        scores = torch.log_softmax(logits[row, start : start + count], dim=-1)
        logprobs[row, :count] = scores.gather(1, torch.tensor(r.completion)[:, None])[:, 0]
        entropy[row, :count] = -(scores.exp() * scores).sum(dim=-1)
        mask[row, :count] = 1
    return logprobs, entropy, mask


def group_advantages(rewards: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """Each reward minus its group's mean, over the group's standard deviation (GRPO-style)."""
    advantages = torch.zeros_like(rewards)
    for group in groups.unique():
        members = groups == group
        values = rewards[members]
        advantages[members] = (values - values.mean()) / (values.std(unbiased=False) + 1e-6)
    return advantages


def learn(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    rollouts: Sequence[Rollout],
    rewards: Sequence[float],
    objective: Objective,
    temperature: float,
) -> dict[str, float]:
    """One optimiser step on a batch of rollouts; the step's metrics."""
    with torch.no_grad():
        old, _, _ = token_logprobs(model, rollouts, temperature)
    new, entropy, mask = token_logprobs(model, rollouts, temperature)
    rollout = torch.zeros_like(old)
    for row, r in enumerate(rollouts):
        rollout[row, : len(r.logprobs)] = torch.tensor(r.logprobs)
    reward = torch.tensor(list(rewards), dtype=torch.float32)
    advantages = group_advantages(reward, torch.tensor([r.group for r in rollouts]))
    loss, metrics = policy_loss(Batch(new, old, rollout, advantages, mask, entropy.detach()), objective)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return {"reward": reward.mean().item(), **metrics}
