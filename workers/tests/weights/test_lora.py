"""LoRA jobs, the trainer's side (lockstep_workers.weights.lora): the adapter's target modules, found from the model and
checked against it; the names of its tensors in the trainer and in PEFT's files; a published version is a file
PEFT loads, computing what the trainer's sharded model computes, whose base never moves."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from lockstep.api import LoraSettings, Training
from lockstep_workers.rollout.record import Rollout
from lockstep_workers.tiny_model import create_tiny_llama
from lockstep_workers.weights import lora

LINEAR = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
"""The tiny Llama's linear modules in its decoder layers."""


def tiny(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(create_tiny_llama(path), dtype=torch.float32)


def test_the_default_targets_are_every_linear_module_of_the_decoder_layers(tmp_path: Path) -> None:
    model = tiny(tmp_path / "model")
    assert lora.linear_modules(model) == LINEAR
    config = lora.adapter_config(LoraSettings(rank=4, alpha=8, dropout=0.1), model)
    assert (config.r, config.lora_alpha, config.lora_dropout, config.bias) == (4, 8, 0.1, "none")
    assert config.task_type == "CAUSAL_LM"
    written = json.loads(lora.config_json(config))
    assert written["target_modules"] == LINEAR, "an explicit sorted list, never the lm_head"
    assert (written["r"], written["lora_alpha"], written["peft_type"]) == (4, 8, "LORA")
    with_head = lora.adapter_config(LoraSettings(target_modules=["v_proj", "q_proj"], train_lm_head=True), model)
    assert json.loads(lora.config_json(with_head))["target_modules"] == ["lm_head", "q_proj", "v_proj"]
    assert lora.adapter_metadata(config) == {"format": "pt", "adapter_config": lora.config_json(config)}


def test_a_target_module_the_model_lacks_is_refused_naming_those_it_has(tmp_path: Path) -> None:
    from lockstep_workers.trainer.model import build

    model = tiny(tmp_path / "model")
    expected = (
        r"^spec\.trainer\.lora\.targetModules: the model has no module named 'qkv_proj'; its linear modules are: "
        r"down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj$"
    )
    with pytest.raises(lora.LoraSettingsError, match=expected):
        lora.adapter_config(LoraSettings(target_modules=["q_proj", "qkv_proj"]), model)
    with pytest.raises(lora.LoraSettingsError, match=r"lm_head gets an adapter only with spec\.trainer\.lora\.trainLm"):
        lora.adapter_config(LoraSettings(target_modules=["lm_head"]), model)
    head_only = lora.adapter_config(LoraSettings(target_modules=["lm_head"], train_lm_head=True), model)
    assert head_only.target_modules == {"lm_head"}
    settings = Training(reward="lockstep_workers.rewards:target_words", lora={"targetModules": ["qkv_proj"]})
    with pytest.raises(SystemExit, match=expected):  # at the trainer's start, before it shards anything
        build(str(tmp_path / "model"), settings, None, mesh=None)


def test_the_trainers_parameter_names_map_to_peft_file_names_and_back(tmp_path: Path) -> None:
    from peft import get_peft_model, get_peft_model_state_dict

    model = tiny(tmp_path / "model")
    config = lora.adapter_config(LoraSettings(rank=2), model)
    wrapped = get_peft_model(model, config)
    assert wrapped.base_model.model is model, "the adapter is injected into the model itself"
    live = {name: p for name, p in model.named_parameters() if p.requires_grad}
    assert len(live) == 2 * 2 * len(LINEAR), "A and B of each target in each of the 2 layers; nothing else trains"
    stored = get_peft_model_state_dict(wrapped)
    assert set(lora.file_names(live)) == set(stored), "the names PeftModel.save_pretrained writes"
    assert set(lora.live_names(stored)) == set(live)
    name = "model.layers.1.mlp.down_proj.lora_B.default.weight"
    assert lora.file_name(name) == "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"
    assert lora.live_name(lora.file_name(name)) == name
    with pytest.raises(ValueError, match=r"is not a LoRA adapter's parameter"):
        lora.file_name("model.layers.1.mlp.down_proj.base_layer.weight")
    with pytest.raises(ValueError, match=r"is not a LoRA adapter tensor's file name"):
        lora.live_name("model.layers.1.mlp.down_proj.weight")


def test_a_published_versions_adapter_config_is_read_from_its_header(tmp_path: Path) -> None:
    from lockstep_workers.weights.files import local_path, publish

    config = lora.adapter_config(LoraSettings(rank=2, target_modules=["q_proj"]), tiny(tmp_path / "model"))
    tensors = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(2, 128)}
    path = local_path(publish(tensors, tmp_path / "weights", version=1, metadata=lora.adapter_metadata(config)))
    found = lora.adapter_config_of(path)
    assert found == json.loads(lora.config_json(config)) and found["target_modules"] == ["q_proj"]
    full = local_path(publish({"model.norm.weight": torch.ones(128)}, tmp_path / "weights", version=2))
    with pytest.raises(ValueError, match=r"is not a LoRA adapter version: its header has no 'adapter_config'"):
        lora.adapter_config_of(full)


ROLLOUTS = [
    Rollout([1, 10 + n, 11], [(7 * n + 3 * k) % 250 + 3 for k in range(6)], [-5.5] * 6, n // 2) for n in range(8)
]
REWARDS = [float(n % 2) for n in range(8)]


def _train_an_adapter(rank: int, model: str, out: str, train_lm_head: bool) -> None:
    """One rank: the trainer's model (trainer.model.build) for a LoRA job, 2 learning steps, then what it publishes, its
    logprobs of ROLLOUTS, its base parameters and its optimizer's state size; the same size for a full job."""
    from lockstep.api import Objective
    from lockstep_workers.trainer import sharding
    from lockstep_workers.trainer.learner import learn, token_logprobs
    from lockstep_workers.trainer.model import build

    torch.set_num_threads(1)
    mesh = sharding.start(rank, 1, torch.device("cpu"))
    settings = Training(
        reward="lockstep_workers.rewards:target_words",
        objective={"algorithm": "grpo", "learningRate": 0.01, "minibatches": 1},
        lora={"rank": 4, "alpha": 8, "trainLmHead": train_lm_head},
    )
    trained = build(model, settings, None, mesh)
    frozen = {n: t for n, t in sharding.full_state_dict(trained.causal_lm).items() if n not in trained.trainable()}
    for _ in range(2):
        learn(trained.policy, trained.optimizer, ROLLOUTS, REWARDS, Objective(algorithm="grpo", minibatches=1), 1.0)
    with torch.no_grad():
        logprobs, _, _ = token_logprobs(trained.policy, ROLLOUTS, 1.0)
    after = sharding.full_state_dict(trained.causal_lm)
    full = build(model, settings.model_copy(update={"lora": None}), None, mesh)
    learn(full.policy, full.optimizer, ROLLOUTS, REWARDS, Objective(algorithm="grpo", minibatches=1), 1.0)

    def state_bytes(optimizer: torch.optim.Optimizer) -> int:
        return sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if t.dim() > 0)

    result = {
        "published": trained.gathered()[0],
        "metadata": trained.metadata(),
        "logprobs": logprobs,
        "frozen_before": frozen,
        "frozen_after": {n: after[n] for n in frozen},
        "trains": sorted(trained.trainable()),
        "optimized": sum(len(group["params"]) for group in trained.optimizer.param_groups),
        "optimizer_bytes": {"lora": state_bytes(trained.optimizer), "full": state_bytes(full.optimizer)},
    }
    torch.save(result, out)
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("train_lm_head", [False, True])
def test_a_published_adapter_loads_with_peft_and_computes_what_the_trainer_does(
    tmp_path: Path, train_lm_head: bool
) -> None:
    """The trainer's sharded LoRA model (FSDP2, fp32 head; with trainLmHead the head's adapter computed by the
    trainer's own head path) learns 2 steps; its base does not move; the version it publishes, loaded by PEFT from
    adapter_config.json (written from the header) and adapter_model.safetensors onto the base model from disk, gives
    the trainer's logprobs. Prints the optimizer state of the adapter against that of every weight."""
    from peft import PeftModel

    from lockstep_workers.weights.files import local_path, publish

    model = create_tiny_llama(tmp_path / "model")
    out = tmp_path / "results.pt"
    mp.spawn(_train_an_adapter, args=(str(model), str(out), train_lm_head), nprocs=1)
    results = torch.load(out, weights_only=False)

    assert results["optimized"] == len(results["trains"]), "the optimizer holds the adapter alone"
    assert all(".lora_A.default." in n or ".lora_B.default." in n for n in results["trains"])
    assert any(n.startswith("lm_head.") for n in results["trains"]) == train_lm_head
    for name, tensor in results["frozen_before"].items():
        assert torch.equal(results["frozen_after"][name], tensor), f"the base moved: {name}"
    published = results["published"]
    assert set(published) == {lora.file_name(n) for n in results["trains"]}
    unmoved = [n for n, t in published.items() if n.endswith("lora_B.weight") and not t.abs().sum() > 0]
    assert not unmoved, f"every adapter learns (lora_B starts at zero): {unmoved}"

    weights = publish(published, tmp_path / "weights", version=2, metadata=results["metadata"])
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps(lora.adapter_config_of(local_path(weights))))
    shutil.copy(local_path(weights), adapter / "adapter_model.safetensors")
    peft_model = PeftModel.from_pretrained(tiny(tmp_path / "model"), str(adapter))
    peft_model.eval()
    ids = torch.tensor([r.prompt + r.completion for r in ROLLOUTS])  # all of one length
    with torch.no_grad():
        scores = peft_model(input_ids=ids).logits.float().log_softmax(-1)
    for row, r in enumerate(ROLLOUTS):
        start = len(r.prompt) - 1
        expected = scores[row, start : start + len(r.completion)].gather(1, torch.tensor(r.completion)[:, None])[:, 0]
        torch.testing.assert_close(results["logprobs"][row, : len(r.completion)], expected, rtol=1e-5, atol=1e-5)
    without = tiny(tmp_path / "model")(input_ids=ids).logits.float().log_softmax(-1)
    assert (without - scores).abs().max() > 1e-3, "the adapter changes what the model computes"

    sizes = results["optimizer_bytes"]
    print(f"Adam state of the tiny Llama: LoRA r=4 {sizes['lora']} bytes, every weight {sizes['full']} bytes")
    assert 0 < sizes["lora"] < sizes["full"]
