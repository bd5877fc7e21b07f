"""The trainer's optimiser (spec.trainer.objective.optimizer): AdamW on the parameters that train, the gradient's
global norm and its clipping before each optimiser step, and the learning rate's warm-up and schedule over the
job's steps.

The schedule is a function of the step alone (``learning_rate_factor``): a resumed trainer starts it at its first
step, and the checkpoint's step is all the state it needs; the optimizer's own state (AdamW's moments and step
counts) is in the checkpoint (lockstep_workers.trainer.checkpoint).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from lockstep.api import LearningRateSchedule, Objective, OptimizerSettings


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
    when that is below 1, as clip_grad_norm_ scales them (0: never scaled). Parameters without a gradient (a LoRA
    job's frozen base) are not in it."""
    gradients = [parameter.grad for parameter in parameters if parameter.grad is not None]
    total = torch.nn.utils.get_total_norm(gradients)
    norm = float(total.full_tensor() if isinstance(total, DTensor) else total)
    scale = max_norm / (norm + 1e-6)
    if max_norm > 0 and scale < 1:
        for gradient in gradients:
            gradient.mul_(scale)  # each rank its own shard
    return norm
