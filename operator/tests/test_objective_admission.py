"""spec.trainer.objective.rolloutCorrection: what admission refuses, in the words `lockstep validate` shares with
the API server (the CRD's schema and CEL rules), naming the field."""

from __future__ import annotations

from typing import Any

import pytest

from factories import job
from lockstep.cli import schema_errors

FIELD = "spec.trainer.objective.rolloutCorrection"


def errors(correction: dict[str, Any]) -> list[str]:
    spec = job()["spec"]
    spec["trainer"]["objective"] = {"rolloutCorrection": correction}
    return schema_errors(spec)


@pytest.mark.parametrize(
    "correction",
    [
        {},
        {"level": "sequence", "mode": "mask", "upper": 3.0},
        {"level": "geometric", "mode": "mask", "lower": 0.5, "upper": 2.0, "veto": 1.0e-4},
        {"mode": "truncate", "lower": 0.1, "upper": 5.0},
        {"enabled": False},
    ],
)
def test_coherent_corrections_are_admitted(correction: dict[str, Any]) -> None:
    assert errors(correction) == []


@pytest.mark.parametrize("ignored", [{"veto": 1.0e-4}, {"lower": 0.5}, {"level": "token"}])
def test_a_disabled_correction_with_settings_it_would_ignore_is_refused(ignored: dict[str, Any]) -> None:
    [error] = errors({"enabled": False, **ignored})
    assert error.startswith(f"{FIELD}.enabled: Invalid value: ") and "remove them, or set enabled: true" in error


@pytest.mark.parametrize(
    ("correction", "field"),
    [
        ({"upper": 1.0}, "upper"),
        ({"lower": 1.0}, "lower"),
        ({"lower": -0.1}, "lower"),
        ({"veto": 0.0}, "veto"),
        ({"veto": 1.5}, "veto"),
        ({"level": "batch"}, "level"),
        ({"mode": "clip"}, "mode"),
    ],
)
def test_bounds_out_of_range_and_unknown_values_are_refused_by_name(correction: dict[str, Any], field: str) -> None:
    [error] = errors(correction)
    assert error.startswith(f"{FIELD}.{field}: "), error


def test_a_minimum_learning_rate_ratio_without_a_decaying_schedule_is_refused() -> None:
    spec = job()["spec"]
    spec["trainer"]["objective"] = {"optimizer": {"minLearningRateRatio": 0.1}}
    [error] = schema_errors(spec)
    assert error.startswith("spec.trainer.objective.optimizer.minLearningRateRatio: Invalid value: "), error
    assert "set schedule: linear or cosine" in error
    spec["trainer"]["objective"]["optimizer"] |= {"schedule": "cosine", "warmupSteps": 5, "betas": [0.9, 0.95]}
    assert schema_errors(spec) == []
    spec["trainer"]["objective"]["optimizer"]["betas"] = [0.9, 1.0]
    [error] = schema_errors(spec)
    assert error.startswith("spec.trainer.objective.optimizer.betas[1]: "), error


def test_a_warm_up_longer_than_the_job_is_refused() -> None:
    spec = job()["spec"]
    spec["trainer"] |= {"steps": 10, "objective": {"optimizer": {"warmupSteps": 11}}}
    [error] = schema_errors(spec)
    assert error.startswith("spec.trainer.objective.optimizer.warmupSteps: Invalid value: "), error
    spec["trainer"]["objective"] |= {
        "optimizer": {"warmupSteps": 10},
        "advantage": "rloo",
        "lossAggregation": "seq-mean-token-sum-norm",
        "entropyCoefficient": 0.001,
    }
    assert schema_errors(spec) == []
    spec["trainer"]["objective"]["advantage"] = "gae"
    [error] = schema_errors(spec)
    assert error.startswith("spec.trainer.objective.advantage: Unsupported value: "), error


def test_a_warm_up_given_both_in_steps_and_as_a_ratio_is_refused() -> None:
    spec = job()["spec"]
    spec["trainer"]["objective"] = {"optimizer": {"warmupRatio": 0.1}}
    assert schema_errors(spec) == []
    spec["trainer"]["objective"]["optimizer"]["warmupSteps"] = 2
    [error] = schema_errors(spec)
    assert error.startswith("spec.trainer.objective.optimizer.warmupRatio: Invalid value: "), error
    assert "sets the warm-up twice" in error


def test_a_kl_term_is_admitted_with_or_without_a_lora_adapter_and_a_negative_one_is_refused() -> None:
    spec = job()["spec"]
    spec["trainer"]["objective"] = {"klCoefficient": 0.01, "klEstimator": "k3"}
    assert schema_errors(spec) == [], "full fine-tuning: a frozen copy of the model is the reference"
    spec["trainer"]["objective"]["klReferenceOffload"] = True
    assert schema_errors(spec) == [], "its frozen copy may live in host memory"
    spec["trainer"]["objective"]["klCoefficient"] = -0.01
    [error] = schema_errors(spec)
    assert error.startswith("spec.trainer.objective.klCoefficient: Invalid value: "), error


@pytest.mark.parametrize(
    "trainer",
    [{"objective": {"klReferenceOffload": True}}, {"objective": {"klCoefficient": 0.01, "klReferenceOffload": True}}],
    ids=["without a KL term", "in a LoRA job"],
)
def test_offloading_a_kl_reference_there_is_none_of_is_refused(trainer: dict[str, Any]) -> None:
    spec = job()["spec"]
    spec["trainer"].update(trainer)
    if "klCoefficient" in trainer["objective"]:
        spec["trainer"]["lora"] = {"rank": 8}
    [error] = schema_errors(spec)
    assert error.startswith("spec.trainer.objective.klReferenceOffload: Invalid value: "), error
    assert "needs klCoefficient above 0 and no spec.trainer.lora" in error
