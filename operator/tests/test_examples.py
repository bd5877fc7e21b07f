"""Every RLJob in examples/ passes `lockstep validate` offline (the schema, the CRD's CEL rules, the shipped default
ParityPolicy), as the API server and the operator would take it."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from factories import policy
from lockstep.cli import main

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def validate(*args: str) -> int:
    """``lockstep validate ARGS``: its exit status (what it prints, capsys has)."""
    with pytest.raises(SystemExit) as exited:
        main(["validate", *args])
    return int(exited.value.code or 0)


@pytest.mark.parametrize("example", sorted(EXAMPLES.glob("*.yaml")), ids=lambda path: path.name)
def test_every_example_is_valid_under_the_default_policy(example: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status = validate(str(example))
    printed = capsys.readouterr().out
    assert status == 0, printed
    assert printed.splitlines()[-1].startswith(f"{example}: valid under ParityPolicy 'default' (Enforce)"), printed


def replay_policy(directory: Path) -> str:
    """A file of a coherent ParityPolicy 'replay' that requires routing replay."""
    required = policy("replay", routingReplay="Required")
    required["spec"]["vllm"]["enablePrefixCaching"] = True
    required["spec"]["weightUpdate"]["clearCache"] = True
    path = directory / "policy.yaml"
    path.write_text(yaml.safe_dump(required))
    return str(path)


def test_the_multinode_example_cannot_replay_its_routing_being_pipeline_parallel(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    example = EXAMPLES / "rljob-multinode.yaml"
    assert validate(str(example), "--policy", replay_policy(tmp_path)) == 1
    assert capsys.readouterr().out.splitlines() == [
        f"{example}: refused by the API server:",
        "  spec.actors.group.pipelineParallelSize: ParityPolicy 'replay' (Enforce) requires routing replay (its "
        "spec.routingReplay is Required), which vLLM cannot do with pipeline parallelism; set "
        "spec.actors.group.pipelineParallelSize to 1, or name a ParityPolicy whose spec.routingReplay is Allowed",
    ]


def test_the_multinode_example_replays_split_as_its_comment_says(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = yaml.safe_load((EXAMPLES / "rljob-multinode.yaml").read_text())
    job["spec"]["actors"]["group"].update(tensorParallelSize=16, pipelineParallelSize=1)
    job["spec"]["actors"]["routingReplay"] = True
    replaying = tmp_path / "replaying.yaml"
    replaying.write_text(yaml.safe_dump(job))
    for policy_args in ([], ["--policy", replay_policy(tmp_path)]):
        assert validate(str(replaying), *policy_args) == 0, capsys.readouterr().out
