"""The architectures the verified matrix measured failing are refused, naming the architecture and why; any other
model (another architecture, a hub name without a local config.json) is not. A mixture of experts is told as vLLM
tells it, and what a job asks of it that this vLLM build cannot do (a LoRA adapter, routing replay without Triton) is
refused, saying why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lockstep_workers.actor.architectures import (
    REFUSED,
    UnsupportedArchitecture,
    architectures,
    check_architecture,
    is_moe,
    moe_engine_args,
)
from lockstep_workers.tiny_models import FAMILIES


def model_of(directory: Path, architecture: str) -> str:
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"architectures": [architecture]}))
    return str(directory)


def test_a_refused_architecture_is_named_with_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(REFUSED, "MixtralForCausalLM", "its experts stay stale after an update")
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


# -- a mixture of experts on this vLLM build ---------------------------------------------------------------------


def config_of(directory: Path, config: dict[str, object]) -> str:
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


def test_a_mixture_of_experts_is_told_by_its_config_as_vllm_tells_it(tmp_path: Path) -> None:
    import transformers

    for family in FAMILIES:  # each family's own config, as transformers writes it
        directory = tmp_path / family.name
        config_class = getattr(transformers, family.config_class)
        config_class(**family.fields, num_hidden_layers=2, architectures=[family.architecture]).save_pretrained(
            directory
        )
        assert is_moe(str(directory)) is family.mixture_of_experts, family.name
    assert is_moe(config_of(tmp_path / "deepseek", {"n_routed_experts": 64}))
    assert is_moe(config_of(tmp_path / "vl", {"text_config": {"num_experts": 128}}))
    assert is_moe(config_of(tmp_path / "no-experts", {"num_local_experts": 0})) is False
    assert is_moe(str(tmp_path / "absent")) is None


MOE = {"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4}
DENSE = {"architectures": ["LlamaForCausalLM"]}
RETURN_ROUTED = {"enable_return_routed_experts": True}


@pytest.mark.parametrize(
    ("config", "lora", "replay", "has_triton", "engine_args"),
    [
        (MOE, False, True, True, RETURN_ROUTED),
        (MOE, True, True, True, RETURN_ROUTED),  # the GPU path stays open
        (MOE, True, False, True, {}),
        (MOE, False, False, False, {}),
        (DENSE, False, True, False, {}),  # moot: nothing asked, nothing refused
        (DENSE, True, True, False, {}),
        (None, False, True, True, RETURN_ROUTED),  # a hub name: vLLM is asked, and judges
        (None, True, False, False, {}),
    ],
)
def test_what_a_job_asks_of_the_engine(
    tmp_path: Path,
    config: dict[str, object] | None,
    lora: bool,
    replay: bool,
    has_triton: bool,
    engine_args: dict[str, bool],
) -> None:
    model = config_of(tmp_path / "model", config) if config else "Qwen/Qwen3-30B-A3B"
    assert moe_engine_args(model, lora=lora, routing_replay=replay, has_triton=has_triton) == engine_args


def test_a_lora_job_on_a_mixture_of_experts_without_triton_is_refused_saying_why(tmp_path: Path) -> None:
    model = config_of(tmp_path / "moe", MOE)
    with pytest.raises(UnsupportedArchitecture) as refused:
        moe_engine_args(model, lora=True, routing_replay=False, has_triton=False)
    assert str(refused.value) == (
        f"the model {model} is a mixture of experts, and vLLM's LoRA kernels for experts need Triton, which this vLLM "
        "build (the CPU build) lacks: a LoRA job (spec.trainer.lora) cannot run on it here. Run the actors' CUDA "
        "image, or remove spec.trainer.lora to train every weight"
    )


def test_routing_replay_on_a_mixture_of_experts_without_triton_is_refused_saying_why(tmp_path: Path) -> None:
    model = config_of(tmp_path / "moe", MOE)
    with pytest.raises(UnsupportedArchitecture) as refused:
        moe_engine_args(model, lora=False, routing_replay=True, has_triton=False)
    assert str(refused.value) == (
        f"routing replay (spec.actors.routingReplay, or the ParityPolicy's spec.routingReplay Required): the model "
        f"{model} is a mixture of experts, and this vLLM build (the CPU build) cannot return the experts each token "
        "was routed to (vLLM returns them only from its Model Runner V2, which needs Triton). Set "
        "spec.actors.routingReplay to false (under a ParityPolicy that does not require it), or run the actors' CUDA "
        "image"
    )


def test_routing_replay_on_a_model_that_may_be_a_mixture_of_experts_is_refused_without_triton() -> None:
    with pytest.raises(UnsupportedArchitecture, match=r"the model Qwen/Qwen3-30B-A3B may be a mixture of experts"):
        moe_engine_args("Qwen/Qwen3-30B-A3B", lora=False, routing_replay=True, has_triton=False)
