"""The vLLM actor keeps a long request running across pause → reload → resume, and every token's
processed logprob matches the trainer's forward pass under the weights version it was sampled with."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil
import pytest

pytestmark = pytest.mark.vllm

TEMPERATURE = 0.7


def trainer_logprobs(model_dir: Path, state: dict[str, Any] | None, prompt: list[int], tokens: list[int]) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if state is not None:  # a tied model's state names the head once, as its embeddings
        model.load_state_dict(state, strict=not model.config.tie_word_embeddings)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits / TEMPERATURE, dim=-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


PROMPT = [1, 10, 11, 12, 13]
LONG_REQUEST = {"temperature": TEMPERATURE, "max_tokens": 300, "ignore_eos": True, "seed": 3}
"""A request long enough to span a weight update."""


def updated_model(model_dir: Path, directory: Path) -> tuple[dict[str, Any], Any]:
    """The tiny model with a perturbed lm_head (its embeddings, when the head is tied to them), and those weights
    published as version 1."""
    import torch
    from safetensors.torch import load_file

    from lockstep_workers.weights.files import publish

    generator = torch.Generator().manual_seed(7)
    weights = load_file(str(model_dir / "model.safetensors"))
    heads = {"lm_head.weight"} & set(weights) or {"model.embed_tokens.weight"}
    updated = {
        name: t + 0.5 * torch.randn(t.shape, generator=generator) if name in heads else t for name, t in weights.items()
    }
    return updated, publish(updated, directory, version=1)


def assert_spans_the_update(result: dict[str, Any], model_dir: Path, updated: dict[str, Any]) -> None:
    """The long request ran before and after the update to version 1, each token's logprob exact under the
    weights it was sampled with."""
    import torch

    tokens, logprobs, versions = result["token_ids"], result["logprobs"], result["weights_versions"]
    assert len(tokens) == 300
    switch = versions.index(1)
    assert 0 < switch < 300 and set(versions[:switch]) == {0} and set(versions[switch:]) == {1}, (
        "the request must have run before and after the update"
    )
    before = trainer_logprobs(model_dir, None, PROMPT, tokens)
    after = trainer_logprobs(model_dir, updated, PROMPT, tokens)
    sampled = torch.tensor(logprobs)
    assert (sampled[:switch] - before[:switch]).abs().max().item() < 1e-3
    assert (sampled[switch:] - after[switch:]).abs().max().item() < 1e-3, "tokens after the update use the new weights"
    assert (sampled[switch:] - before[switch:]).abs().max().item() > 0.05, "the new weights really differ"


def test_a_request_spans_an_in_flight_update_with_exact_logprobs(tmp_path: Path) -> None:
    """On a tiny Llama whose head is tied to its embeddings, the update moving them: the tokens after the update are
    exact under the new embeddings and head, which a head left as vLLM's repacked copy of the old ones would break by
    tenths of a nat (test_vllm_extension_tied_head.py: the same on the real model)."""
    from vllm.v1.engine.async_llm import AsyncLLM

    from lockstep_workers.actor.server import Actor, applied_settings, engine_args
    from lockstep_workers.tiny_model import cpu_vllm_settings, create_tiny_llama
    from lockstep_workers.weights.files import DigestMismatch, WeightsDirectory

    model_dir = create_tiny_llama(tmp_path / "model", tie_word_embeddings=True)
    updated, weights = updated_model(model_dir, tmp_path / "weights")

    async def scenario() -> dict[str, Any]:
        llm = AsyncLLM.from_engine_args(engine_args(str(model_dir), applied_settings(cpu_vllm_settings())))
        actor = Actor(llm)
        try:
            request = asyncio.create_task(actor.generate(PROMPT, LONG_REQUEST))
            await asyncio.sleep(0.5)
            await actor.pause()
            origin = WeightsDirectory(tmp_path / "weights")
            wrong = weights.model_copy(update={"digest": "sha256:" + "0" * 64})
            with pytest.raises(DigestMismatch):
                origin.read(wrong)
            assert actor.loaded == actor.serving == 0, "a refused load changes nothing"
            with origin.read(weights) as verified:  # vLLM's workers read the checked copy, in another process
                await actor.load(weights, verified)
            assert actor.serving == 0, "until resumed, tokens are the old weights' (sampled before the pause)"
            await actor.resume()
            [update] = actor.updates
            assert update["version"] == actor.serving == 1
            assert update["pausedAt"] <= update["loadedAt"] <= update["resumedAt"]  # type: ignore[operator]
            return await request
        finally:
            llm.shutdown()

    result = asyncio.run(scenario())
    assert_spans_the_update(result, model_dir, updated)
    assert result["routed_experts"] is None, "a dense model, without routing replay"


@contextmanager
def actor_process(tmp_path: Path) -> Iterator[tuple[str, Path, subprocess.Popen[bytes]]]:
    """``python -m lockstep_workers.actor`` on a tiny model with the arguments the operator renders under the
    default policy; yields its URL, its model and the process once it reports ready (its log: ``actor.log``)."""
    from lockstep.api import VllmSettings
    from lockstep.parity import default_policy, settings_dict
    from lockstep.podconfig import actor_args
    from lockstep_e2e.cluster import free_port
    from lockstep_workers.tiny_model import create_tiny_llama

    model_dir = create_tiny_llama(tmp_path / "model")
    port = free_port()
    vllm = {
        **settings_dict(default_policy().spec.vllm),
        "dtype": "float32",
        "enforceEager": True,
        "maxModelLen": 256,
        "gpuMemoryUtilization": 0.2,
    }
    settings = VllmSettings.model_validate(vllm)
    argv = [sys.executable, "-m", "lockstep_workers.actor", *actor_args(str(model_dir), port, settings)]
    with (tmp_path / "actor.log").open("w") as log:
        actor = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 240
            while True:
                assert actor.poll() is None, (tmp_path / "actor.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "the actor did not become ready"
                try:
                    with urllib.request.urlopen(f"{base}/ready", timeout=2) as response:
                        if json.loads(response.read())["ready"]:
                            break
                except OSError:
                    time.sleep(1)
            yield base, model_dir, actor
        finally:
            _stop(actor)


def _stop(actor: subprocess.Popen[bytes]) -> None:
    """SIGTERM (the actor then shuts vLLM down); kill whatever is still there after a minute."""
    if actor.poll() is not None:
        return
    children = psutil.Process(actor.pid).children(recursive=True)
    actor.terminate()
    try:
        actor.wait(timeout=60)
    except subprocess.TimeoutExpired:
        actor.kill()
    _, alive = psutil.wait_procs(children, timeout=30)
    for process in alive:
        process.kill()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, subprocess.Popen[bytes]]]:
    """One actor process for the module's tests that only send it requests; the last test stops it."""
    with actor_process(tmp_path_factory.mktemp("actor")) as started:
        yield started


GENERATED = "lockstep_actor_generated_tokens_total "


def generated_tokens(base: str) -> float:
    """The actor's count of generated tokens, from its /metrics."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=5) as response:
        [line] = [line for line in response.read().decode().splitlines() if line.startswith(GENERATED)]
    return float(line.split()[-1])


def test_the_actor_process_serves_the_operators_arguments_and_nothing_else(
    served: tuple[str, Path, subprocess.Popen[bytes]],
) -> None:
    base, model_dir, _ = served
    with urllib.request.urlopen(f"{base}/ready", timeout=5) as response:
        ready = json.loads(response.read())
    assert ready["engineArgs"] == {
        "logprobs_mode": "processed_logprobs",
        "enable_prefix_caching": False,
        "async_scheduling": False,
        "hf_overrides": {"head_dtype": "float32"},
        "dtype": "float32",
        "enforce_eager": True,
        "max_model_len": 256,
        "gpu_memory_utilization": 0.2,
    }, "every setting the operator rendered but one, applied by vLLM's names"
    assert ready["satisfiedByConstruction"] == ["disableCascadeAttn"], "vLLM 0.32 has no cascade attention"
    log = (model_dir.parent / "actor.log").read_text()
    assert "UserWarning: --disable-cascade-attn" not in log, "not passed"
    before = generated_tokens(base)
    body = json.dumps(
        {"prompt_token_ids": [1, 5, 6], "sampling": {"temperature": 0.7, "max_tokens": 8, "ignore_eos": True}}
    ).encode()
    request = urllib.request.Request(f"{base}/generate", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        result = json.loads(response.read())
    assert len(result["token_ids"]) == len(result["logprobs"]) == len(result["weights_versions"]) == 8
    assert all(lp <= 0 for lp in result["logprobs"])
    assert generated_tokens(base) == before + 8
    bad = {
        b"not json": "body: not JSON",
        b'{"sampling": {}}': "prompt_token_ids: expected a non-empty list",
        b'{"prompt_token_ids": [1, "2"]}': "prompt_token_ids: expected a non-empty list",
        b'{"prompt_token_ids": [1], "sampling": []}': "sampling: expected an object",
        b'{"prompt_token_ids": [1], "sampling": {"temperature": -1}}': "sampling: temperature must be",
        b'{"prompt_token_ids": [1], "sampling": {"colour": 1}}': "sampling: ",
        b'{"prompt_token_ids": [1, 99999999]}': "prompt_token_ids or sampling: ",
        b'{"prompt_token_ids": [1], "sampling": {"n": 2}}': "sampling.n: the actor returns one completion",
        b'{"prompt_token_ids": [1], "sampling": {"logprobs": 5}}': "sampling: ",
        b"[1, 2]": "prompt_token_ids: expected a non-empty list",
    }
    for sent, named in bad.items():
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(urllib.request.Request(f"{base}/generate", data=sent), timeout=30)
        assert refused.value.code == 400, sent
        assert json.loads(refused.value.read())["error"].startswith(named), sent
    for path in ("/collective_rpc", "/reset_prefix_cache", "/v1/completions"):
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(urllib.request.Request(f"{base}{path}", data=b"{}"), timeout=5)
        assert missing.value.code in (404, 405)


async def two_turns(row: Mapping[str, Any], prompt_token_ids: list[int], client: Any) -> Any:
    """A toy two-turn episode: the policy answers, the environment inserts three tokens, the policy answers again."""
    from lockstep_workers.episodes import Episode

    first = await client.generate(prompt_token_ids)
    inserted = [40, 41, 42]
    second = await client.generate(prompt_token_ids + first.token_ids + inserted, {"max_tokens": 5})
    return Episode(
        first.token_ids + inserted + second.token_ids,
        first.logprobs + [0.0] * len(inserted) + second.logprobs,
        [True] * len(first.token_ids) + [False] * len(inserted) + [True] * len(second.token_ids),
    )


def test_trainer_recomputes_the_actors_logprobs_under_the_locked_config(
    served: tuple[str, Path, subprocess.Popen[bytes]],
) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from lockstep.api import Objective
    from lockstep_workers.rewards import target_words
    from lockstep_workers.rollout.client import FixedActors, collect_rollouts
    from lockstep_workers.trainer.learner import Policy, learn

    base, model_dir, _ = served
    sampling = {"temperature": 0.7, "max_tokens": 12, "ignore_eos": True}
    rollouts = asyncio.run(collect_rollouts(FixedActors([base]), [[1, 10, 11], [1, 20, 21]], 4, sampling))
    episodes = asyncio.run(collect_rollouts(FixedActors([base]), [[1, 30, 31]], 4, sampling, function=two_turns))
    assert len(rollouts) == 8 and all(len(r.completion) == 12 for r in rollouts)
    assert all(r.policy_mask == [True] * 12 + [False] * 3 + [True] * 5 for r in episodes)
    rollouts += [replace(r, group=2) for r in episodes]  # the second turn is exact after the inserted tokens
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    metrics = learn(
        Policy(model),
        torch.optim.Adam(model.parameters(), lr=1e-3),
        rollouts,
        [target_words(r.prompt, r.completion) for r in rollouts],
        Objective(),
        0.7,
    )
    print(
        f"actor vs trainer: mean |logprob difference| {metrics['mean_abs_logprob_diff']:.2e}, ESS {metrics['ess']:.6f}"
    )
    assert metrics["mean_abs_logprob_diff"] < 1e-4
    assert metrics["ess"] > 0.9999


def test_sigterm_shuts_the_actor_process_down_cleanly(served: tuple[str, Path, subprocess.Popen[bytes]]) -> None:
    """Last in the module: it stops the process the tests before it shared."""
    _, _, actor = served
    children = psutil.Process(actor.pid).children(recursive=True)
    assert children, "vLLM runs its engine in child processes"
    actor.terminate()
    assert actor.wait(timeout=60) == 0, "SIGTERM shuts the actor down cleanly"
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, f"vLLM processes left behind: {alive}"
