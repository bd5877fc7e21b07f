"""The architectures the verified matrix measured failing are refused, naming the architecture and why; any other
model (another architecture, a hub name without a local config.json) is not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lockstep_workers.architectures import REFUSED, UnsupportedArchitecture, architectures, check_architecture
from lockstep_workers.tiny_models import FAMILIES


def model_of(directory: Path, architecture: str) -> str:
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"architectures": [architecture]}))
    return str(directory)


def test_a_refused_architecture_is_named_with_why(tmp_path: Path) -> None:
    model = model_of(tmp_path / "moe", "MixtralForCausalLM")
    with pytest.raises(UnsupportedArchitecture) as refused:
        check_architecture(model)
    assert f"the model {model} is of an architecture" in str(refused.value)
    assert f"MixtralForCausalLM: {REFUSED['MixtralForCausalLM']}" in str(refused.value)
    assert "docs/models.md" in str(refused.value)


def test_another_architecture_or_a_hub_name_is_not_refused(tmp_path: Path) -> None:
    check_architecture(model_of(tmp_path / "llama", "LlamaForCausalLM"))
    check_architecture("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert architectures(str(tmp_path / "absent")) == []


def test_every_refused_architecture_is_one_the_matrix_measures() -> None:
    assert set(REFUSED) <= {f.architecture for f in FAMILIES}
