"""The policy-gradient objective and its mismatch metrics, in one function.

``policy_loss`` takes the trainer's current token logprobs (with gradient), the trainer's logprobs
under the policy that generated the batch (``old``), the rollout engine's processed logprobs
(``rollout``), sequence advantages and a mask, and returns the loss and a flat metrics dict:

- PPO: token ratio r = exp(new - old), clipped to [1 - eps_low, 1 + eps_high], mean over all tokens.
- GRPO: the same clipped token objective, averaged within each sequence, then over sequences.
- GSPO: one ratio per sequence, exp(mean over its tokens of new - old), clipped the same way.
- Truncated importance sampling (TIS): each token's term is weighted by min(exp(old - rollout), C),
  the correction for what is left of the train-inference mismatch (per sequence for GSPO: the
  length-normalised ratio, capped the same way).

Metrics: ``clamp_log_ratio_new_old_indicator`` (fraction clipped), ``kl_new_old`` = mean(e^x - x - 1)
with x = new - old, ``ess`` = (Σw)² / (N Σw²) of the importance weights exp(old - rollout),
``mean_abs_logprob_diff`` = mean |old - rollout|, ``tis_weight_mean``, and ``entropy`` when given.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lockstep.api import Algorithm, Objective


@dataclass(frozen=True)
class Batch:
    """[sequences, tokens] tensors, padded; ``mask`` is 1 on completion tokens."""

    new: torch.Tensor
    old: torch.Tensor
    rollout: torch.Tensor
    advantages: torch.Tensor  # [sequences]
    mask: torch.Tensor
    entropy: torch.Tensor | None = None


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1)


def _per_sequence_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)


def _clipped(ratio: torch.Tensor, advantages: torch.Tensor, objective: Objective) -> tuple[torch.Tensor, torch.Tensor]:
    """The PPO-clip surrogate (to maximise) and where the ratio left the trust region."""
    low, high = 1 - objective.clip_epsilon_low, 1 + objective.clip_epsilon_high
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(low, high) * advantages)
    return surrogate, ((ratio < low) | (ratio > high)).float()


def loss_denominator(mask: torch.Tensor, objective: Objective) -> float:
    """What ``policy_loss`` averages over in a batch with this [sequences, tokens] mask: its completion tokens for
    PPO, its sequences for GRPO and GSPO (the weight of the batch's loss in a larger one)."""
    return float(mask.sum().item()) if objective.algorithm is Algorithm.PPO else float(mask.shape[0])


def policy_loss(batch: Batch, objective: Objective) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss to minimise and the step's metrics (plain floats)."""
    mask = batch.mask.float()
    old, rollout = batch.old.detach(), batch.rollout.detach()
    log_ratio = batch.new - old
    mismatch = (old - rollout) * mask
    tis = objective.truncated_importance_sampling
    if objective.algorithm is Algorithm.GSPO:
        sequence_ratio = torch.exp(_per_sequence_mean(log_ratio, mask))
        surrogate, clipped = _clipped(sequence_ratio, batch.advantages, objective)
        weight = torch.exp(_per_sequence_mean(mismatch, mask)).clamp(max=tis.cap)
        if not tis.enabled:
            weight = torch.ones_like(weight)
        loss = -(surrogate * weight).mean()
        clip_rate, weight_mean = clipped.mean(), weight.mean()
    else:
        surrogate, clipped = _clipped(torch.exp(log_ratio), batch.advantages[:, None], objective)
        weight = torch.exp(mismatch).clamp(max=tis.cap) if tis.enabled else torch.ones_like(mismatch)
        weighted = surrogate * weight
        if objective.algorithm is Algorithm.GRPO:
            loss = -_per_sequence_mean(weighted, mask).mean()
        else:
            loss = -_masked_mean(weighted, mask)
        clip_rate, weight_mean = _masked_mean(clipped, mask), _masked_mean(weight, mask)
    with torch.no_grad():
        x = log_ratio.detach()
        importance = torch.exp(mismatch)[mask.bool()]
        metrics = {
            "loss": loss.item(),
            "clamp_log_ratio_new_old_indicator": clip_rate.item(),
            "kl_new_old": _masked_mean(torch.exp(x) - x - 1, mask).item(),
            "ess": (importance.sum() ** 2 / (importance.numel() * (importance**2).sum())).item(),
            "mean_abs_logprob_diff": _masked_mean(mismatch.abs(), mask).item(),
            "tis_weight_mean": weight_mean.item(),
        }
        if batch.entropy is not None:
            metrics["entropy"] = _masked_mean(batch.entropy, mask).item()
    return loss, metrics
