"""The policy-gradient objective, the rollout correction and the step's metrics.

Three policies, kept apart as decoupled PPO asks: the behaviour policy that sampled the batch (vLLM's processed
logprobs, ``rollout``), the proximal policy (the trainer's recompute of the same tokens before the step, ``old``)
and the policy being trained (``new``, with gradient).

``policy_loss`` returns a micro-batch's loss and its ``Statistics``: sums and counts, added over micro-batches,
minibatches and ranks, and divided once per step (``Statistics.metrics``), so that every metric is the same for
any micro-batch size and any number of ranks. docs/corrections.md gives every metric's formula and peer name.

- PPO: token ratio r = exp(new - old), clipped to [1 - eps_low, 1 + eps_high], mean over all kept tokens. With
  a dual-clip ratio c (off by default), a term with a negative advantage A is at least c A, as verl's vanilla loss.
- GRPO: the same clipped token objective, averaged within each sequence, then over sequences.
- GSPO: one ratio per sequence, s = exp(mean over its tokens of new - old), clipped the same way; in its token form
  (each token's term has the value of s and the gradient of its own logprob), so that a token-level correction
  weights each token's gradient. With one weight per sequence it is the sequence form, value and gradient.

A sequence with no kept token is not in the loss (nor in its denominator) and measures nothing.

The rollout correction (``RolloutCorrection``) weights each token's term by w, a function of the importance ratio
rho = exp(old - rollout) per token, their product per sequence or their geometric mean per sequence (``level``),
truncated to [lower, upper] or zeroed outside it (``mode``), zeroed for a sequence with a token below ``veto``. It
is never folded into the policy ratio. A term weighted 0 stays in the loss's denominator.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from lockstep.api import (
    Algorithm,
    CorrectionLevel,
    CorrectionMode,
    KlEstimator,
    LossAggregation,
    Objective,
    RolloutCorrection,
)
from lockstep_workers.trainer.routing import routing_metrics

LOG_WEIGHT_BOUND = 20.0
"""Log importance weights are clamped to [-20, 20] before exp (verl's SAFETY_BOUND): a sequence's product of token
ratios overflows otherwise. The mismatch metrics clamp each token's log rho the same before exp (rho, rho squared,
k3): unclamped, one token at log rho = 30 gives chi2_token 1e24, at 360 rho squared overflows, at 710 rho is
infinite and ESS NaN."""
ONPOLICY_MISMATCH = "onpolicy_mean_abs_logprob_diff"
"""The parity measurement: mean |Δlogprob| over the step's tokens sampled wholly under the trainer's weights. A step
with no such token measured nothing: the metric is absent from its metrics (null in metrics.jsonl, "none" in the
log), never 0.0, which would read as perfect parity."""
SUM = "sum:"
MAX = "max:"
"""The prefixes of the statistics in ``learn``'s result, which ``across_ranks`` combines and turns into metrics."""


class NonFiniteLoss(ValueError):
    """A micro-batch's loss is NaN or infinite: the step stops before it steps the optimiser or publishes."""


@dataclass(frozen=True)
class Batch:
    """[sequences, tokens] tensors, padded; ``mask`` is 1 on the tokens in the loss."""

    new: torch.Tensor
    old: torch.Tensor
    rollout: torch.Tensor
    advantages: torch.Tensor  # [sequences]
    mask: torch.Tensor
    entropy: torch.Tensor | None = None
    """The proximal policy's entropy at each token (a metric)."""
    new_entropy: torch.Tensor | None = None
    """The trained policy's, with gradient: the entropy bonus (``Objective.entropy_coefficient``)."""
    reference: torch.Tensor | None = None
    """The reference policy's logprobs: the KL term (``Objective.kl_coefficient``)."""


@dataclass(frozen=True)
class Statistics:
    """Additive statistics: ``sums`` add, ``maxima`` take the larger, over micro-batches, minibatches and ranks (the
    order does not matter); ``metrics`` divides them once."""

    sums: Mapping[str, float] = field(default_factory=dict)
    maxima: Mapping[str, float] = field(default_factory=dict)

    def __add__(self, other: Statistics) -> Statistics:
        sums = {name: self.sums.get(name, 0.0) + other.sums.get(name, 0.0) for name in {*self.sums, *other.sums}}
        maxima = {
            name: max(self.maxima.get(name, -math.inf), other.maxima.get(name, -math.inf))
            for name in {*self.maxima, *other.maxima}
        }
        return Statistics(sums, maxima)

    def as_floats(self) -> dict[str, float]:
        """Flat, as ``learn`` returns them (``SUM`` and ``MAX`` prefixed)."""
        return {**{SUM + k: v for k, v in self.sums.items()}, **{MAX + k: v for k, v in self.maxima.items()}}

    @classmethod
    def from_floats(cls, values: Mapping[str, float]) -> Statistics:
        """The statistics among ``values`` (``as_floats``' keys; other keys are left out)."""
        return cls(
            {k.removeprefix(SUM): v for k, v in values.items() if k.startswith(SUM)},
            {k.removeprefix(MAX): v for k, v in values.items() if k.startswith(MAX)},
        )

    def metrics(self) -> dict[str, float]:
        """The step's metrics: each a ratio of sums, a maximum, or (ESS, chi-squared, the correlation) a function of
        sums, never NaN: an empty denominator gives 0. Only the metrics whose statistics are here."""
        s, m = self.sums, self.maxima

        def ratio(numerator: str, denominator: str) -> float:
            return s[numerator] / s[denominator] if s.get(denominator) else 0.0

        out: dict[str, float] = {}
        if "loss" in s:
            tokens, units = s["tokens"], s["weight_units"]
            out |= {
                "loss": ratio("loss", "loss_units"),
                "clamp_log_ratio_new_old_indicator": ratio("clipped", "clip_units"),
                "kl_new_old": ratio("kl_new_old", "tokens"),
                "ess": _ess(s["rho"], s["rho_squared"], tokens),
                "mean_abs_logprob_diff": ratio("abs_logprob_diff", "tokens"),
                "tis_weight_mean": ratio("weight", "weight_units"),
                "rollout_is_mean": ratio("raw_weight", "weight_units"),
                "rollout_is_eff_sample_size": _ess(s["weight"], s["weight_squared"], units),
                "rollout_is_ratio_fraction_high": ratio("above_upper", "weight_units"),
                "rollout_is_ratio_fraction_low": ratio("below_lower", "weight_units"),
                "rollout_is_masked_fraction": ratio("masked_tokens", "tokens"),
                "rollout_is_veto_fraction": ratio("vetoed", "sequences"),
                "training_ppl": ratio("training_ppl", "sequences"),
                "rollout_ppl": ratio("rollout_ppl", "sequences"),
                "log_ppl_diff": ratio("log_ppl_diff", "sequences"),
                "k3_kl": ratio("k3_kl", "tokens"),
                "chi2_token": ratio("rho_squared", "tokens") - 1 if tokens else 0.0,
                "chi2_seq": ratio("sequence_rho_squared", "sequences") - 1 if s["sequences"] else 0.0,
                "rollout_probs_diff_mean": ratio("probs_diff", "tokens"),
                "rollout_probs_diff_max": max(m.get("probs_diff", 0.0), 0.0),
                "rollout_actor_probs_pearson_corr": _pearson(s, m.get("probs_diff", 0.0)),
            }
        if "dual_clipped" in s:
            out["pg_clipfrac_lower"] = ratio("dual_clipped", "clip_units")
        if "entropy" in s:
            out["entropy"] = ratio("entropy", "tokens")
        if "entropy_bonus" in s:
            out["entropy_bonus"] = ratio("entropy_bonus", "loss_units")
        if "kl_loss" in s:
            out["kl_loss"] = ratio("kl_loss", "loss_units")
            out["kl_ref"] = ratio("kl_ref", "tokens")
        if "optimizer_steps" in s:
            out["grad_norm"] = ratio("grad_norm", "optimizer_steps")
            out["skipped_optimizer_steps"] = s.get("skipped_optimizer_steps", 0.0)
        if "samples" in s:
            out["reward"] = ratio("reward", "samples")
            out["zero_advantage_groups"] = s["zero_advantage_groups"]
            out["zero_advantage_group_fraction"] = ratio("zero_advantage_groups", "groups")
            out["outside_top_p_fraction"] = ratio("outside_top_p", "sampled_tokens")
        out |= routing_metrics(s)
        if "onpolicy_tokens" in s:
            if s["onpolicy_tokens"]:  # else not measured: absent (null in metrics.jsonl), never 0.0
                out[ONPOLICY_MISMATCH] = ratio("onpolicy_abs_logprob_diff", "onpolicy_tokens")
            out["onpolicy_token_fraction"] = ratio("onpolicy_tokens", "tokens")
            out["spanning_sequence_fraction"] = ratio("spanning", "samples")
            out["staleness"] = m["staleness"]
        return out


def _ess(total: float, squares: float, count: float) -> float:
    """(sum w)^2 / (count * sum w^2), as (sum w / count) * (sum w / sum w^2): no square of a sum, which overflows a
    float when the weights are large; 0 when empty."""
    return (total / count) * (total / squares) if count and squares else 0.0


def _pearson(s: Mapping[str, float], largest_difference: float) -> float:
    """Pearson's r of the two policies' token probabilities, from their sums; where it is undefined (a constant
    policy), 1 if the two agree on every token, else 0."""
    n = s["tokens"]
    covariance = n * s["probs_product"] - s["probs"] * s["rollout_probs"]
    spread = (n * s["probs_squared"] - s["probs"] ** 2) * (n * s["rollout_probs_squared"] - s["rollout_probs"] ** 2)
    if n < 2 or spread <= 0:
        return 1.0 if largest_difference == 0 else 0.0
    return covariance / math.sqrt(spread)


def level_of(correction: RolloutCorrection, algorithm: Algorithm) -> CorrectionLevel:
    """The correction's level; unset, the level of the algorithm's own ratio (geometric for gspo)."""
    if correction.level is not None:
        return correction.level
    return CorrectionLevel.GEOMETRIC if algorithm is Algorithm.GSPO else CorrectionLevel.TOKEN


def bounds_of(correction: RolloutCorrection) -> tuple[float, float]:
    """[lower, upper]: lower unset is 0 to truncate (no lower clamp) and 1 / upper to mask."""
    if correction.lower is not None:
        return correction.lower, correction.upper
    return (0.0 if correction.mode is CorrectionMode.TRUNCATE else 1 / correction.upper), correction.upper


@dataclass(frozen=True)
class Correction:
    """The rollout correction of a batch: ``weight`` [sequences, tokens] multiplies each token's term; ``raw`` and
    ``applied`` are the importance weights before and after the correction, one per unit of its level (kept tokens,
    or sequences with a kept token), ``units`` 1 where there is one, ``above`` and ``below`` where the raw weight
    is beyond the bounds; ``vetoed`` [sequences]."""

    weight: torch.Tensor
    raw: torch.Tensor
    applied: torch.Tensor
    units: torch.Tensor
    above: torch.Tensor
    below: torch.Tensor
    vetoed: torch.Tensor


def rollout_correction(
    old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, objective: Objective
) -> Correction:
    """The correction's weights for [sequences, tokens] proximal and behaviour logprobs under a 0/1 ``mask``."""
    correction = objective.rollout_correction
    log_rho = torch.where(mask.bool(), old - rollout, 0.0)
    sequences = mask.sum(dim=-1)
    level = level_of(correction, objective.algorithm)
    if level is CorrectionLevel.TOKEN:
        log_weight, units = log_rho, mask
    else:
        total = log_rho.sum(dim=-1, keepdim=True)
        log_weight = total if level is CorrectionLevel.SEQUENCE else total / sequences.clamp(min=1)[:, None]
        units = (sequences > 0).to(mask.dtype)[:, None]
    raw = torch.exp(log_weight.clamp(-LOG_WEIGHT_BOUND, LOG_WEIGHT_BOUND))
    lower, upper = bounds_of(correction)
    if correction.mode is CorrectionMode.TRUNCATE:
        applied = raw.clamp(lower, upper)
    else:
        applied = raw * ((raw >= lower) & (raw <= upper))
    vetoed = torch.zeros_like(sequences, dtype=torch.bool)
    if correction.veto is not None:
        vetoed = ((log_rho < math.log(correction.veto)) & mask.bool()).any(dim=-1)
        applied = applied * ~vetoed[:, None]
    if not correction.enabled:
        applied, vetoed = torch.ones_like(raw), torch.zeros_like(vetoed)
    weight = applied.expand_as(mask) if level is not CorrectionLevel.TOKEN else applied
    return Correction(weight, raw, applied, units, above=raw > upper, below=raw < lower, vetoed=vetoed)


def aggregation_of(objective: Objective) -> LossAggregation:
    """The objective's loss aggregation; unset, the algorithm's own (token-mean for ppo, else seq-mean-token-mean)."""
    if objective.loss_aggregation is not None:
        return objective.loss_aggregation
    return LossAggregation.TOKEN_MEAN if objective.algorithm is Algorithm.PPO else LossAggregation.SEQ_MEAN_TOKEN_MEAN


def kl_estimate(new: torch.Tensor, reference: torch.Tensor, estimator: KlEstimator) -> torch.Tensor:
    """Per token, an estimate of KL(pi || pi_ref) from x = log pi - log pi_ref at a token sampled from pi (Schulman,
    "Approximating KL divergence"; verl's kl_penalty): k1 = x; k2 = x^2 / 2; k3 = exp(-x) + x - 1 with -x clamped
    to [-20, 20] and the estimate to [-10, 10], as verl's low_var_kl."""
    x = new - reference
    if estimator is KlEstimator.K1:
        return x
    if estimator is KlEstimator.K2:
        return 0.5 * x.square()
    log_ratio = (-x).clamp(-20, 20)
    return (torch.exp(log_ratio) - log_ratio - 1).clamp(-10, 10)


def loss_denominator(mask: torch.Tensor, objective: Objective) -> float:
    """What ``policy_loss`` averages over in a batch with this [sequences, tokens] mask: its kept tokens (token-mean)
    or its sequences with a kept token (the seq-mean aggregations): the weight of the batch's loss in a larger one."""
    if aggregation_of(objective) is LossAggregation.TOKEN_MEAN:
        return float(mask.sum().item())
    return float((mask.sum(dim=-1) > 0).sum().item())


def aggregated(
    terms: torch.Tensor, mask: torch.Tensor, aggregation: LossAggregation, max_tokens: int | None
) -> torch.Tensor:
    """The sum over the loss's units (``loss_denominator``'s) of [sequences, tokens] ``terms`` under a 0/1 ``mask``:
    every kept token's term (token-mean); each sequence's mean (seq-mean-token-mean), or its sum over ``max_tokens``
    (seq-mean-token-sum-norm)."""
    terms = terms * mask
    if aggregation is LossAggregation.TOKEN_MEAN:
        return terms.sum()
    if aggregation is LossAggregation.SEQ_MEAN_TOKEN_MEAN:
        return (terms.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)).sum()
    if max_tokens is None:
        raise ValueError("seq-mean-token-sum-norm divides by spec.trainer.rollout.maxTokens: pass max_tokens")
    return terms.sum() / max_tokens


def policy_loss(batch: Batch, objective: Objective, max_tokens: int | None = None) -> tuple[torch.Tensor, Statistics]:
    """The loss to minimise (the mean over ``loss_denominator``'s units, 0 without any; computed in float64, in
    ``batch.new``'s dtype) and the batch's statistics; ``max_tokens`` (spec.trainer.rollout.maxTokens) is
    seq-mean-token-sum-norm's constant. With an entropy coefficient c, the loss is the policy-gradient loss minus c
    times the trained policy's entropy (``batch.new_entropy``), aggregated alike. A loss that is not finite raises
    NonFiniteLoss, naming the inputs that are not (before any gradient, so no optimiser step and no publish
    follows)."""
    mask = batch.mask.double()
    kept = mask.bool()
    old, rollout = batch.old.detach().double(), batch.rollout.detach().double()
    log_ratio = torch.where(kept, batch.new.double() - old, 0.0)
    lengths = mask.sum(dim=-1)
    has_tokens = (lengths > 0).float()
    if objective.algorithm is Algorithm.GSPO:
        sequence_log_ratio = log_ratio.sum(dim=-1) / lengths.clamp(min=1)
        ratio = torch.exp(sequence_log_ratio.detach()[:, None] + log_ratio - log_ratio.detach())
    else:
        ratio = torch.exp(log_ratio)
    low, high = 1 - objective.clip_epsilon_low, 1 + objective.clip_epsilon_high
    advantages = batch.advantages.double()[:, None]
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(low, high) * advantages)
    clipped = ((ratio.detach() < low) | (ratio.detach() > high)).float() * mask
    dual: dict[str, torch.Tensor] = {}
    if objective.dual_clip_ratio is not None:  # verl's vanilla loss: max(surrogate, c A) where A < 0
        floor = objective.dual_clip_ratio * advantages
        bounded = (advantages < 0) & (surrogate.detach() < floor)
        surrogate = torch.where(bounded, floor, surrogate)
        dual = {"dual_clipped": bounded.double() * mask}
    correction = rollout_correction(old, rollout, mask, objective)
    terms = surrogate * correction.weight
    sequences = has_tokens.sum()
    aggregation = aggregation_of(objective)
    summed = -aggregated(terms, mask, aggregation, max_tokens)
    units = mask.sum() if aggregation is LossAggregation.TOKEN_MEAN else sequences
    bonus = {}
    if objective.entropy_coefficient:
        if batch.new_entropy is None:
            raise ValueError("an entropy coefficient needs the trained policy's entropy (Batch.new_entropy)")
        entropy = aggregated(batch.new_entropy.double(), mask, aggregation, max_tokens)
        summed = summed - objective.entropy_coefficient * entropy
        bonus = {"entropy_bonus": objective.entropy_coefficient * entropy.detach()}
    if objective.kl_coefficient:
        if batch.reference is None:
            raise ValueError("a KL coefficient needs the reference policy's logprobs (Batch.reference)")
        estimate = kl_estimate(batch.new.double(), batch.reference.detach().double(), objective.kl_estimator)
        penalty = objective.kl_coefficient * aggregated(estimate, mask, aggregation, max_tokens)
        summed = summed + penalty
        bonus |= {"kl_loss": penalty.detach(), "kl_ref": (estimate.detach() * mask).sum()}
    if objective.algorithm is Algorithm.GSPO:  # one ratio, so one clip decision, per sequence
        clip = {"clipped": clipped.amax(dim=-1).sum(), "clip_units": sequences}
        clip |= {name: value.amax(dim=-1).sum() for name, value in dual.items()}
    else:
        clip = {"clipped": clipped.sum(), "clip_units": mask.sum()}
        clip |= {name: value.sum() for name, value in dual.items()}
    loss = (summed / units.clamp(min=1)).to(batch.new.dtype)
    with torch.no_grad():
        x = log_ratio.detach()
        sums = {"loss": summed, "loss_units": units, **clip, "kl_new_old": ((torch.exp(x) - x - 1) * mask).sum()}
        sums |= bonus
        mismatch, maxima = _mismatch(old, rollout, mask, correction)
        sums |= mismatch
        if batch.entropy is not None:
            sums["entropy"] = (batch.entropy.double() * mask).sum()
        values = torch.stack([t.double().reshape(()) for t in (*sums.values(), *maxima.values())]).tolist()
    # One transfer to the host (one device synchronisation, not one per value).
    statistics = Statistics(
        dict(zip(sums, values[: len(sums)], strict=True)), dict(zip(maxima, values[len(sums) :], strict=True))
    )
    if not math.isfinite(statistics.sums["loss"]):
        raise NonFiniteLoss(_non_finite(batch, kept, statistics.sums["loss"]))
    return loss, statistics


def _non_finite(batch: Batch, kept: torch.Tensor, loss: float) -> str:
    """Why the loss is ``loss`` (NaN or infinite): which inputs are not finite on the kept tokens."""
    inputs = {
        "the trainer's logprobs (new)": batch.new.detach()[kept],
        "the proximal logprobs (old)": batch.old[kept],
        "the rollout logprobs (vLLM's)": batch.rollout[kept],
        "the advantages (from the rewards)": batch.advantages,
    }
    bad = [f"{name}: {int((~t.isfinite()).sum())} not finite" for name, t in inputs.items() if not t.isfinite().all()]
    return (
        f"the loss is {loss}, so the step stops before its optimiser step and publishes nothing; "
        f"{'; '.join(bad) or 'every input is finite: the loss overflowed'}. A diverged model gives NaN logprobs: "
        "lower spec.trainer.objective.learningRate or resume from an earlier checkpoint"
    )


def _mismatch(
    old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, correction: Correction
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Sums (and the maxima) of the proximal-behaviour mismatch and of the correction's weights."""
    kept = mask.bool()
    old, rollout = torch.where(kept, old, 0.0), torch.where(kept, rollout, 0.0)
    log_rho = old - rollout
    safe_log_rho = log_rho.clamp(-LOG_WEIGHT_BOUND, LOG_WEIGHT_BOUND)
    rho = torch.exp(safe_log_rho) * mask
    lengths = mask.sum(dim=-1)
    sequences = lengths > 0
    mean_old, mean_rollout = old.sum(dim=-1) / lengths.clamp(min=1), rollout.sum(dim=-1) / lengths.clamp(min=1)
    sequence_log_rho = log_rho.sum(dim=-1).clamp(-LOG_WEIGHT_BOUND, LOG_WEIGHT_BOUND)
    p, q = old.exp() * mask, rollout.exp() * mask
    units = correction.units
    raw, applied = correction.raw * units, correction.applied * units
    masked = (correction.weight == 0) & kept
    differences = (p - q).abs()
    largest = {"probs_diff": differences.max() if differences.numel() else differences.new_zeros(())}
    sums = {
        "tokens": mask.sum(),
        "sequences": sequences.sum(),
        "rho": rho.sum(),
        "rho_squared": (rho**2).sum(),
        "abs_logprob_diff": (log_rho.abs() * mask).sum(),
        "k3_kl": ((torch.exp(safe_log_rho) - safe_log_rho - 1) * mask).sum(),
        "training_ppl": (torch.exp(-mean_old) * sequences).sum(),
        "rollout_ppl": (torch.exp(-mean_rollout) * sequences).sum(),
        "log_ppl_diff": ((mean_rollout - mean_old) * sequences).sum(),
        "sequence_rho_squared": (torch.exp(2 * sequence_log_rho) * sequences).sum(),
        "probs": p.sum(),
        "rollout_probs": q.sum(),
        "probs_squared": (p**2).sum(),
        "rollout_probs_squared": (q**2).sum(),
        "probs_product": (p * q).sum(),
        "probs_diff": differences.sum(),
        "weight_units": units.sum(),
        "weight": applied.sum(),
        "weight_squared": (applied**2).sum(),
        "raw_weight": raw.sum(),
        "above_upper": (correction.above * units).sum(),
        "below_lower": (correction.below * units).sum(),
        "masked_tokens": masked.sum(),
        "vetoed": (correction.vetoed & sequences).sum(),
    }
    return sums, largest
