"""The rollout record: one sampled completion as the actors returned it, what the rollout side fills and the trainer
learns from."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Rollout:
    """One sampled completion, with the rollout engine's processed logprob of each token and the
    weights version each token was sampled under."""

    prompt: list[int]
    completion: list[int]
    logprobs: list[float]
    group: int  # completions of the same prompt share a group (GRPO/GSPO advantages)
    versions: list[int] = field(default_factory=list)
    policy_mask: list[bool] = field(default_factory=list)
    """Which completion tokens the policy sampled (a multi-turn rollout's environment inserted the others, which
    stay out of the loss); empty: every one."""
    routed_experts: torch.Tensor | None = field(default=None, compare=False, repr=False)
    """An MoE model's routing in the rollout engine: each token's experts in each MoE layer, [tokens, MoE layers,
    top_k] from the prompt's first token (vLLM's routed_experts; lockstep_workers.trainer.routing); None when the engine
    returned none."""


def lag_of(rollout: Rollout, version: int) -> int:
    """How many versions the oldest token of ``rollout`` was sampled before ``version`` (0 without versions)."""
    return version - min(rollout.versions, default=version)
