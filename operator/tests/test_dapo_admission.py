"""DAPO's knobs and reward shaping in spec.trainer: what admission refuses, in the words `lockstep validate` shares
with the API server (the CRD's schema and CEL rules), naming the field."""

from __future__ import annotations

from typing import Any

import pytest

from factories import job
from lockstep.api import RolloutSettings
from lockstep.cli import schema_errors


def errors(**trainer: Any) -> list[str]:
    spec = job()["spec"]
    spec["trainer"] |= trainer
    return schema_errors(spec)


@pytest.mark.parametrize("rollout", [{}, {"dynamicSampling": True}, {"dynamicSampling": True, "maxExtraGroups": 16}])
def test_dynamic_sampling_with_or_without_its_bound_is_admitted(rollout: dict[str, Any]) -> None:
    assert errors(rollout=rollout) == []


def test_an_extra_groups_bound_without_dynamic_sampling_is_refused() -> None:
    [error] = errors(rollout={"maxExtraGroups": 4})
    assert error.startswith("spec.trainer.rollout.maxExtraGroups: Invalid value: ")
    assert "set dynamicSampling: true, or remove maxExtraGroups" in error


def test_a_step_draws_its_extra_prompts_only_with_dynamic_sampling() -> None:
    assert RolloutSettings(prompts_per_step=8, max_extra_groups=None).prompts_drawn_per_step == 8
    assert RolloutSettings(prompts_per_step=8, dynamic_sampling=True).prompts_drawn_per_step == 16
    assert RolloutSettings(prompts_per_step=8, dynamic_sampling=True, max_extra_groups=3).extra_groups == 3


@pytest.mark.parametrize(
    "overlong",
    [{"mode": "mask"}, {"mode": "penalty", "window": 4}, {"mode": "penalty", "window": 16, "penaltyFactor": 0.5}],
)
def test_coherent_overlong_settings_are_admitted(overlong: dict[str, Any]) -> None:
    assert errors(rollout={"maxTokens": 16, "overlong": overlong}) == []


@pytest.mark.parametrize(
    ("overlong", "field", "words"),
    [
        ({"mode": "penalty"}, "window", "set it with mode penalty, remove it with mode mask"),
        ({"mode": "mask", "window": 4}, "window", "set it with mode penalty, remove it with mode mask"),
        ({"mode": "mask", "penaltyFactor": 2.0}, "penaltyFactor", "remove it, or set mode: penalty"),
        ({"mode": "penalty", "window": 17}, "window", "lower the window, or raise maxTokens"),
    ],
)
def test_overlong_settings_that_make_no_sense_are_refused_by_name(
    overlong: dict[str, Any], field: str, words: str
) -> None:
    [error] = errors(rollout={"maxTokens": 16, "overlong": overlong})
    assert error.startswith(f"spec.trainer.rollout.overlong.{field}: Invalid value: ") and words in error


CORRECT = {"name": "correct", "function": "lockstep_workers.rewards:math_exact_match"}
FORMAT = {"name": "format", "function": "lockstep_workers.rewards:format", "weight": 0.1}


def test_several_weighted_rewards_are_admitted_in_place_of_one() -> None:
    spec = job()["spec"]
    del spec["trainer"]["reward"]
    spec["trainer"]["rewards"] = [CORRECT, FORMAT]
    assert schema_errors(spec) == []


def test_a_job_needs_exactly_one_of_reward_and_rewards() -> None:
    [both] = errors(rewards=[CORRECT])
    spec = job()["spec"]
    del spec["trainer"]["reward"]
    [neither] = schema_errors(spec)
    for error in (both, neither):
        assert error.startswith("spec.trainer.reward: Invalid value: ") and "set one, remove the other" in error


def test_two_reward_functions_of_one_name_are_refused() -> None:
    spec = job()["spec"]
    del spec["trainer"]["reward"]
    spec["trainer"]["rewards"] = [CORRECT, {**FORMAT, "name": "correct"}]
    [error] = schema_errors(spec)
    assert error.startswith("spec.trainer.rewards: Invalid value: ") and "a name of its own" in error


@pytest.mark.parametrize("weight", [1000.5, -1e300])
def test_a_reward_weight_beyond_its_bound_is_refused(weight: float) -> None:
    """Issue 46 item 5: an unbounded weight made a weighted sum that overflows to inf."""
    spec = job()["spec"]
    del spec["trainer"]["reward"]
    spec["trainer"]["rewards"] = [CORRECT, {**FORMAT, "weight": weight}]
    [error] = schema_errors(spec)
    assert error.startswith("spec.trainer.rewards[1].weight: Invalid value: ")
    assert error.endswith(
        "should be less than or equal to 1000" if weight > 0 else "should be greater than or equal to -1000"
    )
    spec["trainer"]["rewards"] = [CORRECT, {**FORMAT, "weight": -1000.0}]
    assert schema_errors(spec) == []
