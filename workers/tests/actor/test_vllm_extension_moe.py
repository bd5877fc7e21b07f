"""Mixture-of-experts layers after an in-flight reload (issue 44), on a tiny Qwen3-MoE (lockstep_workers.tiny_models;
`make models-matrix` runs the reload and the load check on every MoE family, docs/models.md), one engine: vLLM's own
reload leaves the CPU build's experts in the wrong
layout, and the load check names the layer and the expert; the actor's reload (``lockstep_reload``, which prepares
the experts first) serves the new version's logprobs with every published tensor checked; a stale expert is named.

Each version is published as the trainer publishes it: transformers' ``save_pretrained`` (checkpoint names, one
tensor per expert), and also the fused tensors transformers holds in memory."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

TEMPERATURE = 0.7
PROMPTS = [[1, 10, 11, 12, 13], [1, 40, 41]]
TOKENS = 24


@dataclasses.dataclass
class Engine:
    family: str
    llm: Any
    """vLLM's LLM, started on version 0."""
    workdir: Path

    def version(self, seed: int) -> Path:
        """Version ``seed`` of the model (version 0 is the one the engine started on): a directory as
        ``save_pretrained`` writes it."""
        from lockstep_workers.tiny_models import create_tiny_model, family

        directory = self.workdir / f"v{seed}"
        return directory if directory.exists() else create_tiny_model(family(self.family), directory, seed=seed)


@pytest.fixture(scope="module", params=["qwen3-moe"])
def engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    from vllm import LLM

    from lockstep_workers.actor.server import applied_settings
    from lockstep_workers.tiny_model import cpu_vllm_settings

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        patch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc of a function: vLLM's plain reload
        engine = Engine(request.param, None, tmp_path_factory.mktemp(request.param))
        engine.llm = LLM(
            model=str(engine.version(0)),
            worker_extension_cls="lockstep_workers.actor.vllm_extension.WeightReloader",
            **applied_settings(cpu_vllm_settings()).engine_args,
        )
        try:
            yield engine
        finally:
            engine.llm.llm_engine.engine_core.shutdown()


def logprob_differences(llm: Any, model_dir: Path) -> Any:
    """|Δlogprob| of the tokens the engine samples, against transformers' forward of the model at ``model_dir``."""
    import torch
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=TEMPERATURE, max_tokens=TOKENS, logprobs=0, ignore_eos=True, seed=1)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    differences = []
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        completion = output.outputs[0]
        tokens = list(completion.token_ids)
        served = torch.tensor([entry[token].logprob for token, entry in zip(tokens, completion.logprobs, strict=True)])
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].double()
        expected = torch.log_softmax(logits / TEMPERATURE, dim=-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
        differences.append((served.double() - expected).abs())
    return torch.cat(differences)


def vllm_plain_reload(llm: Any, path: Path) -> None:
    """vLLM's own reload of the file at ``path``, without the actor's preparation of the experts."""

    def reload(worker: Any, path: str) -> None:
        from lockstep_workers.weights.files import tensors

        worker.model_runner.reload_weights(weights_iterator=tensors(Path(path)), is_checkpoint_format=True)

    llm.collective_rpc(reload, args=(str(path),))


def test_vllms_own_reload_mis_packs_the_experts_and_the_check_names_one(engine: Engine) -> None:
    """Without the actor's preparation the CPU kernel reads the new experts in the checkpoint's layout: the check
    names a layer and an expert (the logprobs' difference is printed for the record, not asserted)."""
    new = engine.version(1)
    vllm_plain_reload(engine.llm, new / "model.safetensors")
    difference = logprob_differences(engine.llm, new)
    print(f"{engine.family}, vLLM's reload: mean |Δlogprob| {difference.mean():.2e}, max {difference.max():.2e}")
    with pytest.raises(Exception, match=r"model\.layers\.\d\.\w+\.experts: expert \d computes with weights other"):
        engine.llm.collective_rpc("lockstep_check", args=(str(new / "model.safetensors"),))


def test_the_actors_reload_serves_the_new_experts_every_tensor_checked(engine: Engine, tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    new = engine.version(2)
    published = {"checkpoint names": new / "model.safetensors"}
    if engine.family == "qwen3-moe":  # vLLM loads transformers' fused experts of Qwen's MoE families only
        model = AutoModelForCausalLM.from_pretrained(new, dtype=torch.float32)
        save_file({name: tensor.contiguous() for name, tensor in model.state_dict().items()}, tmp_path / "fused.st")
        published["fused names"] = tmp_path / "fused.st"
    for names, path in published.items():
        [report] = engine.llm.collective_rpc("lockstep_reload", args=(str(path),))
        difference = logprob_differences(engine.llm, new)
        print(
            f"{engine.family}, {names}, the actor's reload: mean |Δlogprob| {difference.mean():.2e}, max "
            f"{difference.max():.2e}; load check {report}"
        )
        assert report["unchecked"] == [], "every published tensor, each expert's included"
        assert difference.mean().item() <= 1e-4, "the engine computes with the new version (fp32)"


def test_a_stale_expert_is_named(engine: Engine, tmp_path: Path) -> None:
    """The engine loads a version whose one expert's up projection is the previous version's; the check against the
    version as published names that expert."""
    from safetensors.torch import load_file, save_file

    new, old = engine.version(2), engine.version(1)
    up = {"qwen3-moe": "model.layers.1.mlp.experts.3.up_proj.weight"}.get(
        engine.family, "model.layers.1.block_sparse_moe.experts.3.w3.weight"
    )
    tensors = load_file(str(new / "model.safetensors"))
    tensors[up] = load_file(str(old / "model.safetensors"))[up]
    save_file(tensors, tmp_path / "stale.st")
    engine.llm.collective_rpc("lockstep_reload", args=(str(tmp_path / "stale.st"),))
    with pytest.raises(Exception, match=rf"model\.layers\.1\.\w+\.experts: expert 3 computes .*{re.escape(up)}"):
        engine.llm.collective_rpc("lockstep_check", args=(str(new / "model.safetensors"),))
