"""spec.output: its admission rule (the directory is on a volume the trainer mounts), what the trainer pod reads of it,
and the trainer's lockstep.dev/output report reaching status.output, also in the pass where the job succeeds."""

from __future__ import annotations

import json
from typing import Any

import pytest

from factories import job, running
from lockstep import keys
from lockstep.api import Phase, RLJobSpec
from lockstep.cli import describe_status, schema_errors
from lockstep.protocol import PROTOCOL
from reconcile_helpers import plan_for, settle, status_of

MODELS = {"name": "models", "mountPath": "/models"}
WRITTEN = {
    "protocol": PROTOCOL,
    "path": "/models/out/v000012",
    "version": 12,
    "step": 12,
    "evalReward": 0.45,
    "evalVersion": 9,
    "digest": "sha256:" + "0" * 64,
}
OUTPUT = {"path": "/models/out"}


def output_spec(path: str, mounts: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    spec = job()["spec"]
    spec["output"] = {"path": path}
    if mounts is not None:
        spec["trainer"]["volumes"] = [{"name": m["name"], "emptyDir": {}} for m in mounts]
        spec["trainer"]["volumeMounts"] = mounts
    return spec


@pytest.mark.parametrize("path", ["/models", "/models/out", "/models/a/b"])
def test_an_output_on_a_trainer_volume_is_admitted(path: str) -> None:
    assert schema_errors(output_spec(path, [MODELS])) == []


@pytest.mark.parametrize(
    ("path", "mounts"), [("/models", None), ("/modelsx/out", [MODELS]), ("/data/out", [MODELS]), ("/tmp/out", [])]
)
def test_an_output_off_the_trainers_volumes_is_refused_naming_the_field_and_the_fix(
    path: str, mounts: list[dict[str, Any]] | None
) -> None:
    errors = schema_errors(output_spec(path, mounts))
    assert len(errors) == 1 and errors[0].startswith("spec.output.path: Invalid value: spec.output.path must be on")
    assert "add the volume and its mount" in errors[0]


def test_the_trainer_pod_reads_spec_output_and_a_change_of_it_replaces_the_trainer() -> None:
    from lockstep.desired import pod_config
    from lockstep.parity import default_policy, effective_config

    without = RLJobSpec.model_validate(job()["spec"])
    spec = RLJobSpec.model_validate(output_spec("/models/out", [MODELS]))
    config = effective_config(spec, default_policy())
    assert pod_config(spec, config).output == spec.output
    assert pod_config(without, config).output is None
    hashes = []
    for body in (job(), {**job(), "spec": output_spec("/models/out", [MODELS])}):
        _, pods = settle(body)
        trainer = next(p for p in pods if p["metadata"]["labels"][keys.ROLE] == keys.TRAINER)
        hashes.append(trainer["metadata"]["annotations"][keys.TEMPLATE_HASH])
    assert hashes[0] != hashes[1]


def with_output() -> dict[str, Any]:
    return job(**{k: v for k, v in output_spec("/models/out", [MODELS]).items() if k in ("output", "trainer")})


def test_the_written_model_reaches_status_output_in_the_pass_where_the_job_succeeds() -> None:
    body, pods = settle(with_output())
    pods[2]["metadata"]["annotations"][keys.OUTPUT] = json.dumps(WRITTEN)
    pods[2] = running(pods[2], phase="Succeeded", ready=False)
    done = plan_for(body, pods)
    assert done.status.phase is Phase.SUCCEEDED
    assert done.status.output is not None and done.status.output.path == "/models/out/v000012"
    assert status_of(done)["output"] == WRITTEN
    shown = describe_status("tiny", status_of(done))
    assert (
        "  trained model (spec.output): /models/out/v000012, weights version 12 (last eval reward 0.45 on weights "
        "version 9; sha256:000000000000...)" in shown
    )


def test_a_refused_output_report_names_the_annotation_and_keeps_the_last_valid_one() -> None:
    body, pods = settle(with_output())
    pods[2]["metadata"]["annotations"][keys.OUTPUT] = json.dumps(WRITTEN)
    first = plan_for(body, pods)
    pods[2]["metadata"]["annotations"][keys.OUTPUT] = json.dumps({**WRITTEN, "version": -1})
    refused = plan_for({**body, "status": status_of(first)}, pods)
    assert refused.status.output == first.status.output
    valid = next(c for c in refused.status.conditions if c.type == "TrainerReportsValid")
    assert valid.status.value == "False" and f"{keys.OUTPUT} on the trainer" in valid.message


@pytest.mark.parametrize(
    ("output", "report"),
    [
        (None, WRITTEN),
        (OUTPUT, {**WRITTEN, "path": "/etc/v000012"}),
        (OUTPUT, {**WRITTEN, "path": "/models/out/v000011"}),
        ({"path": "/models/out2"}, WRITTEN),
    ],
    ids=["no-spec-output", "elsewhere", "another-version", "a-sibling-directory"],
)
def test_an_output_report_that_is_not_a_write_of_spec_output_does_not_reach_status_output(
    output: dict[str, str] | None, report: dict[str, Any]
) -> None:
    """Issue 46, risk: rank 0's report was copied to status.output even when spec.output was unset."""
    body, pods = settle(job(**({"output": output} if output else {})))
    pods[2]["metadata"]["annotations"][keys.OUTPUT] = json.dumps(report)
    assert plan_for(body, pods).status.output is None
