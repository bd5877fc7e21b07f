"""The weights benchmark's actor part serves a model whose checkpoint the versions it publishes can replace; its LoRA
parts publish adapters as the trainer does, update the actor with no pause, and measure the trainer's memory in a LoRA
learn step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from lockstep.api import LoraSettings
from lockstep_e2e.bench_weights import (
    full_bytes,
    llama_state_dict,
    lora_adapter,
    lora_part,
    memory_part,
    served_model,
    size_of,
)
from lockstep_workers.actor.adapters import adapter_id
from lockstep_workers.weights.lora import ADAPTER_CONFIG_METADATA

TINY = 0.01
"""GB: the smallest shape (one layer, hidden size 512)."""
LINEAR = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


def test_the_served_model_has_the_names_and_shapes_of_the_published_state_dicts(tmp_path: Path) -> None:
    model_dir = served_model(0.1, tmp_path / "model")
    with safe_open(str(model_dir / "model.safetensors"), "pt") as checkpoint:
        served = {name: list(checkpoint.get_slice(name).get_shape()) for name in checkpoint.keys()}  # noqa: SIM118 (safe_open is not iterable)
    assert served == {name: list(tensor.shape) for name, tensor in llama_state_dict(0.1).items()}
    assert (model_dir / "tokenizer.json").exists(), "vLLM needs a tokenizer beside the weights"


def test_a_lora_version_holds_an_adapter_on_every_linear_module_under_peft_names(tmp_path: Path) -> None:
    model_dir = served_model(TINY, tmp_path / "model")
    tensors, metadata = lora_adapter(model_dir, LoraSettings(), seed=1)
    assert json.loads(metadata[ADAPTER_CONFIG_METADATA])["target_modules"] == LINEAR
    prefix = "base_model.model.model.layers.0."
    expected = {
        f"{prefix}{'mlp' if name in {'down_proj', 'gate_proj', 'up_proj'} else 'self_attn'}.{name}.{weight}.weight"
        for name in LINEAR
        for weight in ("lora_A", "lora_B")
    }
    assert set(tensors) == expected
    assert tensors[f"{prefix}self_attn.q_proj.lora_A.weight"].shape == (16, 512), "rank 16 by default"
    assert full_bytes(TINY) == size_of(llama_state_dict(TINY))
    assert size_of(tensors) < full_bytes(TINY) / 50


def test_the_memory_part_runs_one_learn_step_with_lora_in_a_fresh_process(tmp_path: Path) -> None:
    """The LoRA step alone: the full-weights one is the same code (trainer.model.build and one learn step, without the
    adapter), which the trainer's own tests run (test_trainer.py)."""
    [adapter] = memory_part([TINY], 2, 0.0, tmp_path, modes=(True,))
    assert adapter.lora
    parameters = sum(tensor.numel() for tensor in llama_state_dict(TINY).values())
    assert 0 < adapter.trainable_parameters < parameters / 50 and adapter.parameters >= parameters
    # Adam keeps two fp32 moments (and a step count) per trainable parameter: the adapter's, not the model's.
    assert 8 * adapter.trainable_parameters <= adapter.optimizer_state_bytes < 12 * adapter.trainable_parameters
    assert adapter.peak_rss_learn_gb > 0 and adapter.peak_rss_build_gb >= adapter.rss_after_build_gb > 0


@pytest.mark.vllm
def test_the_lora_part_updates_the_actor_to_each_adapter_with_no_pause(tmp_path: Path) -> None:
    [result] = lora_part([TINY], 3, 0.0, tmp_path)
    assert result.repeats == 3 and result.rank == 16 and result.target_modules == LINEAR
    assert result.recorded_pause_s == 0.0 and not result.recorded_paused, "a LoRA update never pauses"
    assert result.update.pause_s == 0.0 and result.update.pausing_s == 0.0
    assert result.adapter_bytes < result.adapter_file_bytes and result.adapter_bytes < result.full_bytes / 50
    versions = {adapter_id(version) for version in (0, 1, 2, 3)}
    assert adapter_id(3) in result.served_adapters and set(result.served_adapters) <= versions, "new requests take v3"
    assert result.tokens_per_s_updating > 0 and result.tokens_per_s_idle > 0
