"""spec.trainer.lora at admission: the CRD's CEL rules (backend filesystem, immutable), in the words `lockstep
validate` shares with the API server, and the parity admission policy's spec.lora checks, evaluated as the API
server does (celpy), against the operator's own words (lockstep.parity.lora_refusal)."""

from __future__ import annotations

from typing import Any

import pytest

from factories import evaluate, job
from lockstep import admission, api
from lockstep.cli import schema_errors
from lockstep.parity import lora_refusal


def lora_spec(backend: str = "filesystem", **lora: Any) -> dict[str, Any]:
    spec = job()["spec"]
    spec["trainer"]["lora"] = lora
    spec["weightSync"]["backend"] = backend
    if backend != "filesystem":
        del spec["weightSync"]["volume"]
    return spec


def test_a_lora_job_over_filesystem_is_admitted() -> None:
    assert schema_errors(lora_spec(rank=8, targetModules=["q_proj", "v_proj"])) == []


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_a_lora_job_over_a_collective_backend_is_refused_naming_the_field_and_the_fix(backend: str) -> None:
    assert schema_errors(lora_spec(backend)) == [
        "spec.trainer.lora: Invalid value: spec.trainer.lora needs spec.weightSync.backend filesystem: each version "
        "of a LoRA job is an adapter file the actors read from spec.weightSync.volume, and the nccl and gloo "
        "transfers send every weight of the model; use backend filesystem with a volume, or remove spec.trainer.lora"
    ]


def test_a_full_fine_tuning_job_over_gloo_is_still_admitted() -> None:
    spec = lora_spec("gloo")
    del spec["trainer"]["lora"]
    assert schema_errors(spec) == []


LORA = {"rank": 16, "alpha": 32, "dropout": 0.0, "trainLmHead": False}


@pytest.mark.parametrize(
    ("old", "new", "allowed"),
    [
        (None, None, True),
        (LORA, LORA, True),
        (None, LORA, False),  # added
        (LORA, None, False),  # removed
        (LORA, {**LORA, "rank": 8}, False),  # changed
        (LORA, {**LORA, "targetModules": ["q_proj"]}, False),
    ],
)
def test_spec_trainer_lora_is_immutable_including_adding_and_removing_it(
    old: dict[str, Any] | None, new: dict[str, Any] | None, allowed: bool
) -> None:
    rule = api.LORA_IMMUTABLE_RULE
    trainer = {"image": "t", "replicas": 1}
    before, after = {**trainer, **({"lora": old} if old else {})}, {**trainer, **({"lora": new} if new else {})}
    assert bool(evaluate(rule["rule"], self=after, oldSelf=before)) is allowed
    assert rule["message"].startswith("spec.trainer.lora is immutable while the RLJob exists")
    assert rule["message"].endswith("delete the RLJob and create it again with the spec.trainer.lora you want")
    # On spec.trainer itself: a rule on the field would not run when the field is added or removed.
    trainer_rules = api.TrainerSpec.model_json_schema()["x-kubernetes-validations"]
    assert rule in trainer_rules


def _check(requirement: api.Requirement) -> dict[str, str]:
    [check] = [c for c in admission.lora_validations() if f"'{requirement.value}'" in c["expression"]]
    return check


@pytest.mark.parametrize(
    ("requirement", "lora", "refused"),
    [
        (api.Requirement.FORBIDDEN, LORA, True),
        (api.Requirement.FORBIDDEN, None, False),
        (api.Requirement.REQUIRED, None, True),
        (api.Requirement.REQUIRED, LORA, False),
    ],
)
def test_the_parity_admission_policy_refuses_what_an_enforce_policy_forbids_or_requires(
    requirement: api.Requirement, lora: dict[str, Any] | None, refused: bool
) -> None:
    check = _check(requirement)
    trainer = {"image": "t", **({"lora": lora} if lora else {})}
    activation = {
        "object": {"spec": {"trainer": trainer}},
        "params": {"metadata": {"name": "strict"}, "spec": {"lora": requirement.value}},
    }
    assert bool(evaluate(check["expression"], **activation, variables={"enforced": True})) is not refused
    # Not enforced (Warn, Audit, another policy, another namespace): never refused here.
    assert bool(evaluate(check["expression"], **activation, variables={"enforced": False}))
    assert evaluate(check["messageExpression"], **activation) == lora_refusal(requirement, "strict")
    assert check["reason"] == "Invalid"


def test_an_allowing_policy_refuses_neither() -> None:
    for check in admission.lora_validations():
        for trainer in ({"image": "t"}, {"image": "t", "lora": LORA}):
            activation = {
                "object": {"spec": {"trainer": trainer}},
                "params": {"metadata": {"name": "lax"}, "spec": {"lora": "Allowed"}},
                "variables": {"enforced": True},
            }
            assert bool(evaluate(check["expression"], **activation))


def test_the_parity_admission_policy_carries_the_lora_checks() -> None:
    assert admission.policy()["spec"]["validations"][-4:-2] == admission.lora_validations()


def test_target_modules_are_bounded() -> None:
    names = [f"proj_{i}" for i in range(api.MAX_TARGET_MODULES + 1)]
    assert schema_errors(lora_spec(targetModules=names[:-1])) == []
    assert schema_errors(lora_spec(targetModules=names)) == [
        f"spec.trainer.lora.targetModules: Too many: {len(names)}: must have at most {api.MAX_TARGET_MODULES} items"
    ]
