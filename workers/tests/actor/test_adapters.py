"""A LoRA job's actor: each version is an adapter loaded while requests run, with no pause. A request keeps the
adapter it started with, so every token carries one version and its logprob is PEFT's under that adapter; new
requests take the newest adapter once resumed; an adapter beyond maxLag goes once its requests have finished."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from lockstep.api import LoraSettings
from lockstep_workers.actor.adapters import AdapterFiles, AdapterTable, LoraEngine, adapter_id

TEMPERATURE = 0.7
PROMPT = [1, 10, 11, 12, 13]
LONG = {"temperature": TEMPERATURE, "max_tokens": 64, "ignore_eos": True, "seed": 3}
SHORT = {"temperature": TEMPERATURE, "max_tokens": 8, "ignore_eos": True, "seed": 5}


def test_an_adapter_goes_once_beyond_max_lag_and_unused() -> None:
    table = AdapterTable(max_lag=1)
    for version in (0, 1, 2):
        table.add(version)
    assert table.serve(0) == []
    first = table.start()  # a request under the base model's adapter of zeros
    assert first == 0 and table.serve(1) == [] and table.start() == 1
    assert table.serve(2) == [], "version 0 is beyond maxLag of 2, but a request still uses it"
    assert table.finish(first) == [0]
    table.removed(0)
    table.add(3)
    assert table.serve(3) == [], "version 1 is beyond maxLag but still has a request"
    assert table.finish(1) == [1]
    table.removed(1)
    assert table.loaded == {2, 3} and table.removable() == []
    with pytest.raises(ValueError, match="adapter version 7 is not loaded"):
        table.serve(7)


def test_vllm_is_asked_for_max_lag_plus_two_adapters_of_an_allowed_rank() -> None:
    engine = LoraEngine(LoraSettings(rank=12), max_lag=2)
    assert adapter_id(0) == 1, "vLLM's adapter ids start at 1; version 0 is the base model's adapter of zeros"
    assert engine.engine_args() == {"enable_lora": True, "max_loras": 4, "max_cpu_loras": 6, "max_lora_rank": 16}


def test_full_weights_announced_in_a_lora_job_leave_no_copy_in_the_adapter_directory(tmp_path: Path) -> None:
    """Issue 46 item 7: the whole file was copied before its header was found to carry no adapter config."""
    import torch

    from lockstep_workers.weights.files import publish, version_path
    from lockstep_workers.weights.lora import ADAPTER_CONFIG_METADATA

    (tmp_path / "adapters").mkdir()
    files = AdapterFiles(tmp_path / "adapters")
    publish({"model.embed_tokens.weight": torch.ones(4, 2)}, tmp_path / "weights", version=3)
    with pytest.raises(ValueError, match="is not a LoRA adapter version"):
        files.write(3, str(version_path(tmp_path / "weights", 3)))
    assert list(files.root.iterdir()) == []
    config = {"r": 8, "peft_type": "LORA"}
    publish(
        {"a": torch.ones(2)}, tmp_path / "weights", version=4, metadata={ADAPTER_CONFIG_METADATA: json.dumps(config)}
    )
    written = files.write(4, str(version_path(tmp_path / "weights", 4)))
    assert json.loads((written / "adapter_config.json").read_text()) == config
    assert sorted(p.name for p in written.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]


def publish_adapter(model_dir: Path, directory: Path, version: int, seed: int) -> tuple[Any, Any]:
    """A PEFT adapter of the tiny model with random weights (lora_B too, so it changes the outputs), published as
    weights version ``version`` as the trainer publishes one; returns the PEFT model and the announcement."""
    import torch
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from lockstep_workers.weights.files import publish
    from lockstep_workers.weights.lora import adapter_metadata

    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), config).eval()
    tensors = get_peft_model_state_dict(model)
    return model, publish(tensors, directory, version=version, metadata=adapter_metadata(config))


def peft_logprobs(model: Any, tokens: list[int]) -> Any:
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1 : -1]
    return torch.log_softmax(logits / TEMPERATURE, dim=-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


@pytest.mark.vllm
def test_adapters_update_while_requests_run_with_no_pause_and_exact_logprobs(tmp_path: Path) -> None:
    import torch
    from vllm.v1.engine.async_llm import AsyncLLM

    from lockstep_workers.actor.server import PAUSED, Actor, applied_settings, engine_args
    from lockstep_workers.tiny_model import cpu_vllm_settings, create_tiny_llama
    from lockstep_workers.weights.files import WeightsDirectory

    model_dir = create_tiny_llama(tmp_path / "model")
    published = {v: publish_adapter(model_dir, tmp_path / "weights", v, seed=v) for v in (1, 2, 3)}
    origin = WeightsDirectory(tmp_path / "weights")
    lora = LoraEngine(LoraSettings(rank=8), max_lag=1)

    async def scenario() -> tuple[dict[int, list[dict[str, Any]]], Actor, set[int]]:
        llm = AsyncLLM.from_engine_args(engine_args(str(model_dir), applied_settings(cpu_vllm_settings()), lora=lora))
        actor = Actor(llm, lora=lora)
        try:
            started: dict[int, list[asyncio.Task[dict[str, Any]]]] = {}
            for version in (1, 2, 3):
                started[version - 1] = [asyncio.create_task(actor.generate(PROMPT, LONG)) for _ in range(2)]
                await asyncio.sleep(0.3)  # the requests are running when the next adapter is loaded
                await actor.pause()
                with origin.read(published[version][1]) as verified:
                    await actor.load(published[version][1], verified)
                assert actor.serving == version - 1, "new requests take the new adapter only once resumed"
                assert PAUSED._value.get() == 0, "a LoRA update never pauses generation"
                await actor.resume()
            await refuse_broken_adapters(actor, origin, published[1][0], tmp_path / "weights")
            started[3] = [asyncio.create_task(actor.generate(PROMPT, SHORT))]
            results = {v: list(await asyncio.gather(*tasks)) for v, tasks in started.items()}
            return results, actor, await llm.list_loras()
        finally:
            llm.shutdown()

    results, actor, still_loaded = asyncio.run(scenario())
    assert [u["version"] for u in actor.updates] == [1, 2, 3]
    assert all(u["pausedAt"] is None and u["pauseSeconds"] == 0.0 for u in actor.updates), actor.updates
    assert set(still_loaded) == {adapter_id(2), adapter_id(3)}, "versions 0 and 1 are beyond maxLag 1 of version 3"
    assert actor.adapter_files is not None and sorted(p.name for p in actor.adapter_files.root.iterdir()) == [
        "v000002",
        "v000003",
    ], "an unloaded adapter's files go with it"
    worst = {}
    for version, outputs in results.items():
        for output in outputs:
            assert set(output["weights_versions"]) == {version}, "a request keeps the adapter it started with"
            difference = (torch.tensor(output["logprobs"]) - expected_logprobs(published, version, output)).abs()
            print(f"version {version}: {len(difference)} tokens, max |Δlogprob| against PEFT {difference.max():.2e}")
            worst[version] = max(worst.get(version, 0.0), difference.max().item())
    assert all(difference < 1e-3 for difference in worst.values()), f"max |Δlogprob| by version: {worst}"
    base = expected_logprobs(published, 0, results[3][0])
    assert (torch.tensor(results[3][0]["logprobs"]) - base).abs().max().item() > 0.01, "the adapters change tokens"


async def refuse_broken_adapters(actor: Any, origin: Any, model: Any, directory: Path) -> None:
    """Issue 37 item 2: an adapter whose lora_A tensors are twice as wide as its header's rank allows fails to load,
    and so does every retry (a failed add used to stay listed in vLLM, and the retry of the same id was acked as
    loaded); an adapter with a NaN is refused. The actor goes on serving version 3."""
    import torch
    from peft import get_peft_model_state_dict

    from lockstep_workers.weights.files import NonFiniteWeights, publish
    from lockstep_workers.weights.lora import adapter_metadata

    tensors = get_peft_model_state_dict(model)
    config = model.peft_config["default"]
    wide = {name: torch.cat([t, t], dim=1) if "lora_A" in name else t for name, t in tensors.items()}
    poisoned = {name: t.clone() for name, t in tensors.items()}
    next(iter(poisoned.values()))[0, 0] = float("nan")
    with pytest.raises(NonFiniteWeights):
        publish(poisoned, directory, version=5, metadata=adapter_metadata(config))
    for version, broken, why in ((4, wide, "did not load the adapter of weights version 4"), (5, poisoned, "NaN")):
        # The trainer's publish refuses a NaN (above); the actor refuses one however the file was written.
        with mock.patch("lockstep_workers.weights.files.finite", return_value=True):
            weights = publish(broken, directory, version=version, metadata=adapter_metadata(config))
        for _attempt in range(2):
            with origin.read(weights) as verified, pytest.raises((RuntimeError, ValueError), match=why):
                await actor.load(weights, verified)
        assert adapter_id(version) not in await actor.llm.list_loras(), "a failed load leaves nothing registered"
    await actor.resume()
    assert actor.serving == 3 and actor.loaded == 3


def expected_logprobs(published: dict[int, tuple[Any, Any]], version: int, output: dict[str, Any]) -> Any:
    """PEFT's logprobs of ``output``'s tokens under adapter ``version`` (0: the base model, adapters disabled)."""
    if version:
        return peft_logprobs(published[version][0], output["token_ids"])
    with published[1][0].disable_adapter():
        return peft_logprobs(published[1][0], output["token_ids"])
