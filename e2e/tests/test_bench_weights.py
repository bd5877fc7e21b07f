"""The weights benchmark's actor part serves a model whose checkpoint the versions it publishes can replace."""

from __future__ import annotations

from pathlib import Path

from safetensors import safe_open

from lockstep_e2e.bench_weights import llama_state_dict, served_model


def test_the_served_model_has_the_names_and_shapes_of_the_published_state_dicts(tmp_path: Path) -> None:
    model_dir = served_model(0.1, tmp_path / "model")
    with safe_open(str(model_dir / "model.safetensors"), "pt") as checkpoint:
        served = {name: list(checkpoint.get_slice(name).get_shape()) for name in checkpoint.keys()}  # noqa: SIM118 (safe_open is not iterable)
    assert served == {name: list(tensor.shape) for name, tensor in llama_state_dict(0.1).items()}
    assert (model_dir / "tokenizer.json").exists(), "vLLM needs a tokenizer beside the weights"
