"""spec.trainer.objective.optimizer: AdamW's settings, the learning rate's warm-up and schedule (and where a resumed
trainer takes it up), the gradient's global norm and its clipping."""

from __future__ import annotations

import math

import pytest
import torch

from lockstep.api import Objective, OptimizerSettings
from lockstep.reconcile.restarts import TERMINATION_MESSAGE_CHARACTERS
from lockstep_workers.trainer.optimization import (
    MAX_SKIPPED_STEPS_IN_A_ROW,
    NonFiniteGradients,
    SkippedSteps,
    adamw,
    clip_gradients,
    learning_rate_factor,
    scheduler,
)


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({}, [1.0] * 6),
        ({"warmupSteps": 2}, [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]),
        ({"warmupSteps": 2, "schedule": "linear"}, [0.5, 1.0, 0.75, 0.5, 0.25, 0.0]),
        ({"warmupRatio": 0.25, "schedule": "linear"}, [0.5, 1.0, 0.75, 0.5, 0.25, 0.0]),  # ceil(1.5) = 2 steps
        ({"warmupRatio": 1.0}, [1 / 6, 2 / 6, 3 / 6, 4 / 6, 5 / 6, 1.0]),
        ({"schedule": "linear", "minLearningRateRatio": 0.4}, [0.9, 0.8, 0.7, 0.6, 0.5, 0.4]),
        ({"warmupSteps": 2, "schedule": "cosine", "minLearningRateRatio": 0.2}, [0.5, 1.0, 0.88284, 0.6, 0.31716, 0.2]),
    ],
)
def test_the_learning_rate_warms_up_then_follows_its_schedule_to_the_last_step(
    settings: dict[str, object], expected: list[float]
) -> None:
    optimizer = OptimizerSettings.model_validate(settings)
    found = [learning_rate_factor(step, optimizer, 6) for step in range(1, 7)]
    assert found == pytest.approx(expected, abs=1e-5)


def test_a_resumed_trainer_learns_at_the_rate_of_one_that_never_stopped() -> None:
    """A trainer stopped after step 3 restores the optimizer's state (its rate then the decayed one) and starts its
    schedule at step 4: the rates of steps 4 to 6, and AdamW's state, are those of a trainer that never stopped."""
    objective = Objective.model_validate(
        {"learningRate": 0.01, "optimizer": {"warmupSteps": 1, "schedule": "cosine", "weightDecay": 0.1}}
    )
    weights = torch.nn.Parameter(torch.ones(3))

    def train(optimizer: torch.optim.Optimizer, first: int, last: int) -> list[float]:
        schedule, rates = scheduler(optimizer, objective, 6, first), []
        for _ in range(first, last + 1):
            rates.append(schedule.get_last_lr()[0])
            weights.grad = torch.full((3,), 0.5)
            optimizer.step()
            schedule.step()
        return rates

    straight = train(adamw([weights], objective), 1, 6)
    weights.data.fill_(1.0)
    stopped = adamw([weights], objective)
    train(stopped, 1, 3)
    resumed = adamw([weights], objective)
    resumed.load_state_dict(stopped.state_dict())  # what the checkpoint restores
    assert resumed.param_groups[0]["lr"] != 0.01, "the checkpoint holds a decayed rate"
    assert train(resumed, 4, 6) == pytest.approx(straight[3:])
    assert straight[0] == 0.01 and straight[-1] == 0.0
    assert resumed.param_groups[0]["weight_decay"] == 0.1 and resumed.param_groups[0]["betas"] == (0.9, 0.999)


def test_the_gradient_norm_is_measured_before_clipping_over_the_parameters_that_train() -> None:
    trains, frozen = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2), requires_grad=False)
    other = torch.nn.Parameter(torch.zeros(1))
    trains.grad, other.grad = torch.tensor([3.0, 0.0]), torch.tensor([4.0])
    assert clip_gradients([trains, frozen, other], max_norm=0.0) == 5.0
    assert trains.grad.tolist() == [3.0, 0.0], "0: not clipped"
    assert clip_gradients([trains, frozen, other], max_norm=1.0) == 5.0
    assert math.hypot(*trains.grad.tolist(), *other.grad.tolist()) == pytest.approx(1.0, rel=1e-5)
    assert clip_gradients([trains, other], max_norm=2.0) == pytest.approx(1.0, rel=1e-5), "under the bound: kept"
    assert trains.grad.tolist() == pytest.approx([0.6, 0.0], rel=1e-5)


def test_an_infinite_gradient_is_not_clipped_into_nan() -> None:
    weights = torch.nn.Parameter(torch.zeros(2))
    weights.grad = torch.tensor([math.inf, 1.0])
    assert clip_gradients([weights], max_norm=1.0) == math.inf
    assert weights.grad.tolist() == [math.inf, 1.0], "left for the skip, not scaled by 0 into NaN"


def test_steps_with_a_gradient_norm_that_is_not_finite_are_skipped_and_too_many_in_a_row_stop_the_trainer() -> None:
    """Issue 46 item 5: a finite step resets the count; the limit'th non-finite step in a row raises, with a message
    the operator quotes whole (the traceback's last line, the termination message's last 400 characters)."""
    skipped = SkippedSteps()
    assert skipped.allows(3.0)
    for _ in range(MAX_SKIPPED_STEPS_IN_A_ROW - 1):
        assert not skipped.allows(math.nan)
    assert skipped.allows(0.5) and skipped.in_a_row == 0, "a finite step starts the count again"
    for _ in range(MAX_SKIPPED_STEPS_IN_A_ROW - 1):
        assert not skipped.allows(math.inf)
    with pytest.raises(NonFiniteGradients, match=r"5 optimiser steps in a row had gradient norm inf") as stopped:
        skipped.allows(math.inf)
    line = f"{NonFiniteGradients.__module__}.{NonFiniteGradients.__name__}: {stopped.value}"
    assert "\n" not in line and len(line) <= TERMINATION_MESSAGE_CHARACTERS, len(line)
