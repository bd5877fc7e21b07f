"""spec.trainer.objective, the recipe: the policy-gradient algorithm, the advantage estimator, how the loss is
aggregated, its KL and entropy terms, the rollout correction, and the optimizer with its learning-rate schedule."""

from __future__ import annotations

import math
from enum import StrEnum
from typing import Annotated

from pydantic import ConfigDict, Field

from lockstep.api.shared import cel, validations
from lockstep.schema import Model


class Algorithm(StrEnum):
    GSPO = "gspo"
    PPO = "ppo"
    GRPO = "grpo"


class CorrectionLevel(StrEnum):
    TOKEN = "token"
    SEQUENCE = "sequence"
    GEOMETRIC = "geometric"


class CorrectionMode(StrEnum):
    TRUNCATE = "truncate"
    MASK = "mask"


CORRECTION_OFF_RULE = cel(
    "self.enabled || !(has(self.level) || has(self.lower) || has(self.veto))",
    "spec.trainer.objective.rolloutCorrection.enabled is false, so level, lower and veto would be ignored: remove "
    "them, or set enabled: true",
    field_path=".enabled",
    reason="FieldValueInvalid",
)


class RolloutCorrection(Model):
    """The rollout correction (docs/corrections.md): each term of the loss is weighted by a function of the
    importance ratio rho = pi_proximal / pi_behaviour, the trainer's recomputed probability of a sampled token over
    the rollout engine's. It is kept apart from the policy ratio pi_new / pi_proximal, which is clipped."""

    model_config = ConfigDict(json_schema_extra=validations(CORRECTION_OFF_RULE))

    enabled: bool = Field(
        True,
        description="Whether the loss is weighted; off, every weight is 1, and rollout_is_mean and the fractions "
        "beyond the bounds still measure rho.",
    )
    level: CorrectionLevel | None = Field(
        None,
        description="token: one weight per token, rho_t; sequence: one per sequence, the product of its tokens' "
        "rho; geometric: one per sequence, their geometric mean (the length-normalised ratio). Unset: the level of "
        "the algorithm's own ratio, token for ppo and grpo, geometric for gspo.",
    )
    mode: CorrectionMode = Field(
        CorrectionMode.TRUNCATE,
        description="truncate (TIS): the weight is clamped to [lower, upper]; mask (MIS, IcePop's band): a weight "
        "outside [lower, upper] is 0 (its tokens stay in the loss's denominator), one inside is rho itself.",
    )
    upper: Annotated[float, Field(gt=1)] = Field(
        2.0, description="The upper bound on the weight (TIS's cap C in min(rho, C))."
    )
    lower: Annotated[float, Field(ge=0, lt=1)] | None = Field(
        None,
        description="The lower bound on the weight. Unset: 0 (no lower clamp) for truncate, 1 / upper for mask.",
    )
    veto: Annotated[float, Field(gt=0, lt=1)] | None = Field(
        None,
        description="A sequence with any token whose rho is below this gets weight 0 (verl's veto threshold, e.g. "
        "1e-4). Unset: no veto.",
    )


class AdvantageEstimator(StrEnum):
    GRPO = "grpo"
    DR_GRPO = "dr_grpo"
    RLOO = "rloo"
    REINFORCE_PLUS_PLUS = "reinforce_plus_plus"


class LossAggregation(StrEnum):
    TOKEN_MEAN = "token-mean"
    SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"
    SEQ_MEAN_TOKEN_SUM_NORM = "seq-mean-token-sum-norm"


class KlEstimator(StrEnum):
    K1 = "k1"
    K2 = "k2"
    K3 = "k3"


class LearningRateSchedule(StrEnum):
    CONSTANT = "constant"
    LINEAR = "linear"
    COSINE = "cosine"


ONE_WARMUP_RULE = cel(
    "!has(self.warmupRatio) || self.warmupRatio == 0.0 || !has(self.warmupSteps) || self.warmupSteps == 0",
    "spec.trainer.objective.optimizer sets the warm-up twice: warmupSteps counts its steps, warmupRatio its share of "
    "spec.trainer.steps; keep one",
    field_path=".warmupRatio",
)
CONSTANT_SCHEDULE_RULE = cel(
    "!has(self.minLearningRateRatio) || self.minLearningRateRatio == 0.0 || (has(self.schedule) && "
    "self.schedule != 'constant')",
    "spec.trainer.objective.optimizer.minLearningRateRatio is where a linear or cosine schedule ends; a constant "
    "schedule never decays: remove it, or set schedule: linear or cosine",
    field_path=".minLearningRateRatio",
    reason="FieldValueInvalid",
)


class OptimizerSettings(Model):
    """AdamW (torch.optim.AdamW) on the parameters that train, gradient-norm clipping, and the learning rate's
    warm-up and schedule over the job's steps (docs/recipes.md); the peak rate is spec.trainer.objective.learningRate.
    """

    model_config = ConfigDict(json_schema_extra=validations(CONSTANT_SCHEDULE_RULE, ONE_WARMUP_RULE))

    betas: list[Annotated[float, Field(ge=0, lt=1)]] = Field(
        [0.9, 0.999],
        min_length=2,
        max_length=2,
        description="AdamW's [beta1, beta2], the decay rates of the gradient's first and second moment estimates.",
    )
    eps: Annotated[float, Field(gt=0, le=1)] = Field(1e-8, description="AdamW's epsilon, added to the denominator.")
    weight_decay: Annotated[float, Field(ge=0, le=1)] = Field(
        0.0,
        description="AdamW's decoupled weight decay (0: Adam's update), on every parameter that trains, biases and "
        "norm weights too, as verl's (Hugging Face's Trainer and TRL exempt those).",
    )
    max_grad_norm: Annotated[float, Field(ge=0)] = Field(
        1.0,
        description="Each optimiser step first scales the gradient down to this global L2 norm (over every rank's "
        "shard) when it is larger; the norm before clipping is the grad_norm metric. 0: no clipping.",
    )
    warmup_steps: Annotated[int, Field(ge=0)] = Field(
        0,
        description="The learning rate rises linearly over this many steps, step n learning at n / warmupSteps of "
        "learningRate, before the schedule. 0: no warm-up (or warmupRatio's).",
    )
    warmup_ratio: Annotated[float, Field(ge=0, le=1)] = Field(
        0.0,
        description="The warm-up as a fraction of spec.trainer.steps instead: ceil(warmupRatio x steps) steps, as "
        "Hugging Face's warmup_ratio counts them (verl's lr_warmup_steps_ratio rounds down: one step fewer when the "
        "product is not whole). Not with warmupSteps.",
    )
    schedule: LearningRateSchedule = Field(
        LearningRateSchedule.CONSTANT,
        description="After the warm-up: constant (learningRate), or a linear or cosine decay that reaches "
        "minLearningRateRatio x learningRate at the job's last step (spec.trainer.steps).",
    )
    min_learning_rate_ratio: Annotated[float, Field(ge=0, le=1)] = Field(
        0.0, description="Where a linear or cosine schedule ends, as a fraction of learningRate."
    )

    def warmup(self, steps: int) -> int:
        """How many of a job's ``steps`` warm up: warmupSteps, or warmupRatio's share of them rounded up."""
        return self.warmup_steps or math.ceil(self.warmup_ratio * steps)


class Objective(Model):
    algorithm: Algorithm = Field(
        Algorithm.GSPO,
        description="The clipped policy-gradient objective: ppo (token ratios, mean over all tokens), grpo (token "
        "ratios, mean within each sequence, then over sequences) or gspo (one ratio per sequence); lossAggregation "
        "may change how the terms are averaged.",
    )
    advantage: AdvantageEstimator = Field(
        AdvantageEstimator.GRPO,
        description="Each completion's advantage from the rewards (docs/recipes.md): grpo (its reward minus its "
        "group's mean, over the group's standard deviation), dr_grpo (minus the group's mean, no division), rloo "
        "(minus the mean of the group's other completions) or reinforce_plus_plus (the rewards whitened over the "
        "whole step's tokens, every rank's: no group baseline).",
    )
    loss_aggregation: LossAggregation | None = Field(
        None,
        description="How the per-token terms become the loss: token-mean (over every token of the minibatch), "
        "seq-mean-token-mean (each sequence's mean, then the mean over sequences) or seq-mean-token-sum-norm (each "
        "sequence's sum over spec.trainer.rollout.maxTokens, a constant, then the mean over sequences: Dr. GRPO's). "
        "Unset: the algorithm's own, token-mean for ppo, seq-mean-token-mean for grpo and gspo.",
    )
    entropy_coefficient: Annotated[float, Field(ge=0)] = Field(
        0.0,
        description="The loss subtracts this times the trained policy's entropy at the sampled tokens, aggregated "
        "as the loss is (lossAggregation): a bonus for exploration; the term's size is the entropy_bonus metric. 0: "
        "none.",
    )
    kl_coefficient: Annotated[float, Field(ge=0)] = Field(
        0.0,
        description="The loss adds this times an estimate of KL(trained policy || reference) at the sampled tokens, "
        "aggregated as the loss is; the reference is the model the job started from (spec.model): in a LoRA job the "
        "same model with the adapter disabled (no second copy), in full fine-tuning a frozen copy that each trainer "
        "rank holds a shard of (fp32 parameters: a quarter more memory than the trained copy with its gradients and "
        "AdamW state). Metrics kl_ref (the estimate's mean over tokens) and kl_loss (the term). 0: none.",
    )
    router_aux_loss_coefficient: Annotated[float, Field(ge=0)] = Field(
        0.0,
        description="Mixture-of-experts models: the loss adds this times the routers' auxiliary load-balancing loss "
        "(the model family's own, as transformers computes it with output_router_logits), of each micro-batch (so "
        "it varies with tokensPerMicroBatch and the trainer's replicas), weighted by its sequences; metric "
        "router_aux_loss. 0: none, as RL recipes run it (the trainer never adds it unasked).",
    )
    kl_estimator: KlEstimator = Field(
        KlEstimator.K3,
        description="The per-token estimate of the KL, with x = log pi - log pi_ref (Schulman's): k1 = x, k2 = x^2 / "
        "2, k3 = exp(-x) + x - 1 (low variance, always >= 0; verl's low_var_kl, clamped as verl clamps it).",
    )
    kl_reference_offload: bool = Field(
        False,
        description="Full fine-tuning with klCoefficient: keep the frozen reference's parameters in host memory, each "
        "layer copied to the accelerator as its forward pass needs it (FSDP2's CPU offload): no accelerator memory "
        "for the reference between its passes, for one copy of the model from host to accelerator a step. Refused "
        "without klCoefficient or with spec.trainer.lora (whose reference is its base: no copy to offload).",
    )
    clip_epsilon_low: Annotated[float, Field(gt=0, lt=1)] = Field(
        0.2, description="Lower clip range: the ratio is clipped below at 1 - clipEpsilonLow."
    )
    clip_epsilon_high: Annotated[float, Field(gt=0)] = Field(
        0.28, description="Upper clip range: the ratio is clipped above at 1 + clipEpsilonHigh."
    )
    dual_clip_ratio: Annotated[float, Field(gt=1, le=100)] | None = Field(
        None,
        description="Dual-clip PPO (Ye et al. 2020; verl's clip_ratio_c, 3 by default in verl's vanilla loss): a "
        "term with a negative advantage A is bounded below at dualClipRatio x A, so that a ratio far above 1 on a "
        "token to discourage cannot give it an unbounded loss (metric pg_clipfrac_lower, the fraction of terms it "
        "bounds). For every algorithm (gspo: on its sequence ratio). Unset: off, the loss of the single clip.",
    )
    rollout_correction: RolloutCorrection = Field(
        default_factory=RolloutCorrection,
        description="How the loss corrects for the behaviour policy (the rollout engine) differing from the "
        "proximal policy (the trainer's recompute); by default truncated importance sampling with cap 2, at the "
        "level of the algorithm's own ratio.",
    )
    learning_rate: Annotated[float, Field(gt=0, le=1)] = Field(
        1e-6, description="The optimiser's peak learning rate, after the warm-up (optimizer.warmupSteps)."
    )
    optimizer: OptimizerSettings = Field(
        default_factory=OptimizerSettings,
        description="AdamW's settings, gradient-norm clipping (at 1.0 by default) and the learning-rate schedule.",
    )
    minibatches: Annotated[int, Field(ge=1, le=64)] = Field(
        2,
        description="Optimiser steps per batch of rollouts, each on a slice of its prompt groups; ratios are "
        "taken against the weights the batch started from, so clipping acts from the second on.",
    )
    tokens_per_micro_batch: Annotated[int, Field(ge=1)] | None = Field(
        None,
        description="Gradient accumulation: each minibatch is run forward and backward in equal micro-batches of "
        "about this many tokens (padding included) per trainer rank, so that a step's batch need not fit in memory "
        "at once. Unset: a minibatch in one pass.",
    )
