"""vLLM V1 runs on this machine's CPU and returns processed logprobs that match a torch forward pass."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lockstep_workers.tiny_model import create_tiny_llama

    return create_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def test_generates_with_processed_logprobs_matching_the_trainer_forward(tiny_model: Path, tmp_path: Path) -> None:
    """vLLM serves the weights as spec.output and `lockstep export` write them (a published version of the trainer's
    weights, exported as a Hugging Face directory), and its logprobs are the trainer's forward pass's."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from lockstep.api import DType
    from lockstep_workers import export
    from lockstep_workers.weights.files import publish, version_path

    publish(load_file(str(tiny_model / "model.safetensors")), tmp_path / "weights", 1)
    exported = tmp_path / "exported"
    export.write(version_path(tmp_path / "weights", 1), str(tiny_model), exported, DType.FLOAT32)
    llm = LLM(
        model=str(exported),
        dtype="float32",
        logprobs_mode="processed_logprobs",
        enable_prefix_caching=False,
        async_scheduling=False,
        enforce_eager=True,
        gpu_memory_utilization=0.2,
        max_model_len=256,
        hf_overrides={"head_dtype": "float32"},
        seed=0,
    )
    prompts = [[1, 10, 11, 12, 13], [1, 40, 41]]
    params = SamplingParams(temperature=TEMPERATURE, max_tokens=24, logprobs=0, ignore_eos=True, seed=1)
    try:
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    finally:
        llm.llm_engine.engine_core.shutdown()

    reference = AutoModelForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32).eval()
    for prompt, output in zip(prompts, outputs, strict=True):
        completion = output.outputs[0]
        tokens = list(completion.token_ids)
        assert len(tokens) == 24
        sampled = [entry[token].logprob for token, entry in zip(tokens, completion.logprobs, strict=True)]
        assert all(math.isfinite(lp) and lp <= 0 for lp in sampled)

        # The trainer's view: the same tokens, one forward pass, logits scaled by the sampling temperature.
        ids = torch.tensor([prompt + tokens])
        with torch.no_grad():
            logits = reference(ids).logits[0, len(prompt) - 1 : -1].float()
        expected = torch.log_softmax(logits / TEMPERATURE, dim=-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
        raw = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
        difference = (torch.tensor(sampled) - expected).abs().max().item()
        assert difference < 1e-3, f"processed logprobs differ from the trainer's by {difference}"
        # processed (temperature-scaled) logprobs are really not the raw ones
        assert (torch.tensor(sampled) - raw).abs().max().item() > 10 * difference
