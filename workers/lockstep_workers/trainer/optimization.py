"""The trainer's optimiser (spec.trainer.objective.optimizer): AdamW on the parameters that train, the gradient's
global norm and its clipping before each optimiser step, and the learning rate's warm-up and schedule over the
job's steps.

The schedule is a function of the step alone (``learning_rate_factor``): a resumed trainer starts it at its first
step, and the checkpoint's step is all the state it needs; the optimizer's own state (AdamW's moments and step
counts) is in the checkpoint (lockstep_workers.trainer.checkpoint).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from lockstep.api import LearningRateSchedule, Objective, OptimizerSettings

logger = logging.getLogger("lockstep.trainer")

MAX_SKIPPED_STEPS_IN_A_ROW = 5
"""How many optimiser steps in a row may be skipped for a gradient norm that is not finite before the trainer stops
(NonFiniteGradients). One such step is an accident a skip absorbs (one overflowing sample: verl skips it too); with
bf16 or fp32 and no loss scaling, several in a row are not chance but a model or a batch that has gone bad, and every
skipped step still costs the actors a step of rollouts and publishes the same weights again. Five is a few
minibatches: enough to ride out a burst, few enough to stop before a job burns its budget learning nothing."""


class NonFiniteGradients(RuntimeError):
    """MAX_SKIPPED_STEPS_IN_A_ROW optimiser steps in a row had a gradient norm that is not finite: the trainer stops
    (no weight was changed by any of them). Its message is one line, short enough for the operator to quote whole
    as the trainer's termination message."""


@dataclass
class SkippedSteps:
    """The optimiser steps skipped in a row for a gradient norm that is not finite. The norm is the whole model's,
    the same on every rank, so every rank skips, counts and stops alike."""

    in_a_row: int = 0
    limit: int = MAX_SKIPPED_STEPS_IN_A_ROW

    def allows(self, norm: float) -> bool:
        """Whether an optimiser step whose gradient norm is ``norm`` may be taken: yes when it is finite (the count
        starts again); otherwise the step is skipped and counted, and the ``limit``th in a row raises
        NonFiniteGradients."""
        if math.isfinite(norm):
            self.in_a_row = 0
            return True
        self.in_a_row += 1
        if self.in_a_row >= self.limit:
            raise NonFiniteGradients(
                f"{self.in_a_row} optimiser steps in a row had gradient norm {norm}; each was skipped, no weight "
                "changed. Lower spec.trainer.objective.learningRate, check the rewards, or resume from an earlier "
                "checkpoint"
            )
        logger.warning(
            "optimiser step skipped: the gradient norm is %s (%d in a row; the trainer stops at %d); no weight changed",
            norm,
            self.in_a_row,
            self.limit,
        )
        return False


def adamw(parameters: Iterable[torch.nn.Parameter], objective: Objective) -> torch.optim.AdamW:
    """AdamW over ``parameters`` with spec.trainer.objective's rate and optimizer settings (weight decay 0 is
    Adam's update)."""
    settings = objective.optimizer
    beta1, beta2 = settings.betas
    decay = settings.weight_decay
    return torch.optim.AdamW(parameters, objective.learning_rate, (beta1, beta2), settings.eps, weight_decay=decay)


def learning_rate_factor(step: int, settings: OptimizerSettings, steps: int) -> float:
    """The fraction of the peak learning rate that step ``step`` (1 to ``steps``) learns at: n / W over the W
    warm-up steps n (warmupSteps, or warmupRatio's share of ``steps``); then 1 (constant), or a linear or cosine
    decay whose progress is (step - W) / (steps - W), from 1 to minLearningRateRatio at the last step (and after it)."""
    step, warmup = min(step, steps), settings.warmup(steps)
    if step <= warmup:
        return step / warmup
    if settings.schedule is LearningRateSchedule.CONSTANT:
        return 1.0
    progress = (step - warmup) / (steps - warmup)
    if settings.schedule is LearningRateSchedule.LINEAR:
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return settings.min_learning_rate_ratio + (1.0 - settings.min_learning_rate_ratio) * shape


def scheduler(optimizer: torch.optim.Optimizer, objective: Objective, steps: int, first_step: int) -> LambdaLR:
    """The learning-rate schedule from ``first_step`` on (a resumed trainer's, after its checkpoint restored the
    optimizer's state): the optimizer learns at step ``first_step``'s rate, and each ``step()`` moves to the next
    step's. The peak is spec.trainer.objective.learningRate, whatever rate a checkpoint's optimizer state holds."""
    for group in optimizer.param_groups:
        group["lr"] = objective.learning_rate
        group.pop("initial_lr", None)
    settings = objective.optimizer
    return LambdaLR(optimizer, lambda done: learning_rate_factor(first_step + done, settings, steps))


def clip_gradients(parameters: Iterable[torch.nn.Parameter], max_norm: float) -> float:
    """The L2 norm of the gradients of ``parameters`` as one vector, over every rank's shard (FSDP2's gradients are
    DTensors, whose norm get_total_norm reduces over the mesh), before they are scaled by max_norm / (norm + 1e-6)
    when that is below 1, as clip_grad_norm_ scales them (0: never scaled; nor when the norm is not finite, a step
    that ``SkippedSteps`` skips). Parameters without a gradient (a LoRA job's frozen base) are not in it."""
    gradients = [parameter.grad for parameter in parameters if parameter.grad is not None]
    total = torch.nn.utils.get_total_norm(gradients)
    norm = float(total.full_tensor() if isinstance(total, DTensor) else total)
    scale = max_norm / (norm + 1e-6)
    if max_norm > 0 and scale < 1 and math.isfinite(norm):
        for gradient in gradients:
            gradient.mul_(scale)  # each rank its own shard
    return norm
