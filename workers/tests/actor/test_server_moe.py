"""The actor and a mixture of experts: the routed experts it returns with each sample, and its refusal to start
where this vLLM build cannot return them (the CPU build), checked against vLLM's own verdict; the preflight's
refusal of a LoRA job on a mixture of experts there."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from lockstep import environment
from lockstep.podconfig import PodConfig
from lockstep_workers.actor.architectures import vllm_has_triton
from lockstep_workers.actor.server import routed_experts


def test_the_routed_experts_of_a_sample_are_nested_lists_of_tokens_layers_and_top_k() -> None:
    routed = np.arange(3 * 2 * 2, dtype=np.int16).reshape(3, 2, 2)  # 3 tokens, 2 layers, top-2, as vLLM returns
    assert routed_experts(SimpleNamespace(routed_experts=routed)) == [
        [[0, 1], [2, 3]],
        [[4, 5], [6, 7]],
        [[8, 9], [10, 11]],
    ]
    assert routed_experts(SimpleNamespace(routed_experts=None)) is None  # an output before the last, or no replay


def moe_config(directory: Path) -> Path:
    """The config.json of the matrix's tiny Qwen3-MoE (no weights: the actor refuses before loading any)."""
    import transformers

    from lockstep_workers.tiny_models import family

    qwen3_moe = family("qwen3-moe")
    config = getattr(transformers, qwen3_moe.config_class)(
        **qwen3_moe.fields, num_hidden_layers=2, architectures=[qwen3_moe.architecture]
    )
    config.save_pretrained(directory)
    return directory


def test_this_vllm_cannot_return_routed_experts_exactly_when_it_has_no_triton(tmp_path: Path) -> None:
    """What moe_engine_args assumes of vLLM, asked of the installed one (its config check; no engine starts)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    replaying = AsyncEngineArgs(
        model=str(moe_config(tmp_path / "moe")), enable_return_routed_experts=True, enable_prefix_caching=True
    )
    if vllm_has_triton():
        replaying.create_engine_config()
        return
    with pytest.raises(ValueError, match="requires Model Runner V2"):
        replaying.create_engine_config()


def olmoe(directory: Path) -> Path:
    """An OLMoE config.json: a mixture of experts of an architecture the verified matrix does not refuse
    (lockstep_workers.actor.architectures.REFUSED), so that the refusals here are the MoE ones (nothing more of the
    model is read before them)."""
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"architectures": ["OlmoeForCausalLM"], "num_experts": 64}))
    return directory


def pod_config(directory: Path, model: Path, **job: object) -> Path:
    """A job's PodConfig file, with ``job``'s fields (routingReplay, training)."""
    config = PodConfig.model_validate(
        {
            "fingerprint": "sha256:test",
            "policy": "default",
            "model": {"uri": str(model)},
            "vllm": {"enablePrefixCaching": True},
            "trainer": {},
            "weightUpdate": {"clearCache": True},
            "mismatchBudget": {},
            "training": {"reward": "lockstep_workers.rewards:target_words"},
            **job,
        }
    )
    path = directory / "pod-config.json"
    path.write_text(config.text())
    return path


@pytest.mark.skipif(vllm_has_triton(), reason="vLLM with Triton returns routed experts: the actor starts")
def test_the_actor_of_a_replaying_job_on_a_mixture_of_experts_refuses_to_start_on_this_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lockstep_workers.actor.server import command_line

    model = olmoe(tmp_path / "olmoe")
    monkeypatch.setenv(environment.CONFIG, str(pod_config(tmp_path, model, routingReplay=True)))
    monkeypatch.setattr(sys, "argv", ["actor", f"--model={model}", "--enable-prefix-caching"])
    with pytest.raises(SystemExit) as refused:
        command_line()
    assert str(refused.value) == (
        "the actor does not start: routing replay (spec.actors.routingReplay, or the ParityPolicy's "
        f"spec.routingReplay Required): the model {model} is a mixture of experts, and this vLLM build (the CPU build) "
        "cannot return the experts each token was routed to (vLLM returns them only from its Model Runner V2, which "
        "needs Triton). Set spec.actors.routingReplay to false (under a ParityPolicy that does not require it), or "
        "run the actors' CUDA image"
    )


@pytest.mark.skipif(vllm_has_triton(), reason="vLLM with Triton has its MoE LoRA kernels: the preflight starts")
def test_the_preflight_of_a_lora_job_on_a_mixture_of_experts_refuses_to_start_on_this_build(tmp_path: Path) -> None:
    from lockstep_workers.parity_check import Workload, preflight

    model = olmoe(tmp_path / "olmoe")
    lora_job = {"reward": "lockstep_workers.rewards:target_words", "lora": {"rank": 8}}
    config = pod_config(tmp_path, model, training=lora_job)
    with pytest.raises(SystemExit) as refused:
        preflight(model, Workload(), {environment.CONFIG: str(config)})
    assert str(refused.value) == (
        f"the preflight does not start: the model {model} is a mixture of experts, and vLLM's LoRA kernels for "
        "experts need Triton, which this vLLM build (the CPU build) lacks: a LoRA job (spec.trainer.lora) cannot run "
        "on it here. Run the actors' CUDA image, or remove spec.trainer.lora to train every weight"
    )
