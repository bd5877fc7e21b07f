"""After an in-flight update, the actor computes with every tensor of the new version, the head tied to the
embeddings included (a Hugging Face checkpoint of a tied model names only the embeddings), on the real pretrained
model (SmolLM2-135M-Instruct, lockstep_e2e.real_model); on a tiny tied Llama, test_server.py's in-flight update and
weights/test_transfer.py's gloo update check the same. And the load check names a module whose derived copy vLLM did
not refresh."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, ClassVar

import pytest

pytestmark = pytest.mark.vllm

TEMPERATURE = 0.7
PROMPT = [1, 10, 11, 12, 13]


@pytest.fixture(scope="module")
def tied_model() -> Path:
    from lockstep_e2e import real_model

    return real_model.ensure()


def perturbed(model_dir: Path) -> dict[str, Any]:
    """The model's tensors with the embeddings (and so the tied head) moved by half their spread."""
    import torch
    from safetensors.torch import load_file

    generator = torch.Generator().manual_seed(7)
    tensors = load_file(str(model_dir / "model.safetensors"))
    assert "lm_head.weight" not in tensors, "a tied checkpoint names only the embeddings"
    embeddings = tensors["model.embed_tokens.weight"]
    tensors["model.embed_tokens.weight"] = embeddings + 0.5 * embeddings.std() * torch.randn(
        embeddings.shape, generator=generator
    )
    return tensors


def trainer_logprobs(model_dir: Path, state: dict[str, Any], tokens: list[int]) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.load_state_dict(state, strict=False)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1 : -1]
    return torch.log_softmax(logits / TEMPERATURE, dim=-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def test_after_an_in_flight_update_the_tied_head_is_the_new_versions(tied_model: Path, tmp_path: Path) -> None:
    import torch
    from vllm.v1.engine.async_llm import AsyncLLM

    from lockstep_workers.actor.server import Actor, applied_settings, engine_args
    from lockstep_workers.tiny_model import cpu_vllm_settings
    from lockstep_workers.weights.files import WeightsDirectory, publish

    updated = perturbed(tied_model)
    weights = publish(updated, tmp_path / "weights", version=1)
    request = {"temperature": TEMPERATURE, "max_tokens": 40, "ignore_eos": True, "seed": 3}

    async def scenario() -> dict[str, Any]:
        llm = AsyncLLM.from_engine_args(engine_args(str(tied_model), applied_settings(cpu_vllm_settings())))
        actor = Actor(llm)
        try:
            await actor.generate(PROMPT, {**request, "max_tokens": 1})  # the engine has served version 0
            await actor.pause()
            with WeightsDirectory(tmp_path / "weights").read(weights) as verified:
                await actor.load(weights, verified)
            await actor.resume()
            return await actor.generate(PROMPT, request)
        finally:
            llm.shutdown()

    result = asyncio.run(scenario())
    assert set(result["weights_versions"]) == {1}
    tokens = result["token_ids"]
    expected = trainer_logprobs(tied_model, updated, tokens)
    difference = (torch.tensor(result["logprobs"]) - expected).abs()
    print(f"{tied_model.name}: after the update, mean |Δlogprob| {difference.mean():.2e}, max {difference.max():.2e}")
    assert difference.mean().item() <= 1e-4, "the engine computes with the new embeddings and head (fp32)"


def test_the_load_check_names_a_head_whose_derived_copy_was_not_refreshed(tmp_path: Path) -> None:
    """The check, on a model built as vLLM builds it (a module whose kernel reads a copy derived at load)."""
    import torch

    from lockstep_workers.actor.load_check import LoadMismatch, check_loaded, retie, tied_groups
    from lockstep_workers.weights.files import local_path, publish

    class Kernel:
        """Computes with a copy of the weight taken when processed, like vLLM's CPU repacking."""

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            layer.packed = layer.weight.detach().clone()

        def apply(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
            return x @ layer.packed.T

    class Layer(torch.nn.Module):
        def __init__(self, weight: torch.nn.Parameter) -> None:
            super().__init__()
            self.weight = weight
            self.quant_method = Kernel()
            self.quant_method.process_weights_after_loading(self)

    class Model(torch.nn.Module):
        packed_modules_mapping: ClassVar = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}

        def __init__(self) -> None:
            super().__init__()
            self.model = torch.nn.Module()
            self.model.embed_tokens = Layer(torch.nn.Parameter(torch.randn(16, 8)))
            self.model.qkv_proj = Layer(torch.nn.Parameter(torch.randn(12, 8)))
            self.lm_head = Layer(self.model.embed_tokens.weight)

    model = Model()
    groups = tied_groups(model)
    assert groups == [["model.embed_tokens", "lm_head"]]
    new = {"model.embed_tokens.weight": torch.randn(16, 8)}
    new |= {f"model.{part}.weight": torch.randn(4, 8) for part in ("q_proj", "k_proj", "v_proj")}
    path = local_path(publish(new, tmp_path, version=1))
    with torch.no_grad():  # what vLLM's reload does: the named tensors, loaded and processed; the tied head not
        model.model.embed_tokens.weight.copy_(new["model.embed_tokens.weight"])
        model.model.embed_tokens.quant_method.process_weights_after_loading(model.model.embed_tokens)
        model.model.qkv_proj.weight.copy_(torch.cat([new[f"model.{p}_proj.weight"] for p in "qkv"]))
        model.model.qkv_proj.quant_method.process_weights_after_loading(model.model.qkv_proj)
    with pytest.raises(LoadMismatch, match="lm_head: vLLM computes with weights other than the published"):
        check_loaded(model, path, groups)
    retie(model, groups)
    report = check_loaded(model, path, groups)
    assert report.modules == 3 and report.unchecked == []
    with torch.no_grad():
        model.model.qkv_proj.weight[5, 0] += 1  # half a fused module loaded
    with pytest.raises(LoadMismatch, match=r"model.qkv_proj: its weight is not the published model.q_proj.weight \+"):
        check_loaded(model, path, groups)
