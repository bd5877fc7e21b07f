"""A tiny random model learns the demo task with the trainer's step: the reward rises."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lockstep.api import Objective, TruncatedImportanceSampling
from lockstep_workers.rewards import target_words
from lockstep_workers.tiny_model import create_tiny_llama
from lockstep_workers.trainer import Rollout, learn, load_reward, token_logprobs

TEMPERATURE = 1.0


def sample(model: torch.nn.Module, prompts: list[list[int]], group: int, length: int) -> list[Rollout]:
    """Sample completions from the model itself (a stand-in for the actors), with their logprobs."""
    rollouts = []
    generator = torch.Generator().manual_seed(len(prompts) * 1000 + group)
    for index, prompt in enumerate(prompts):
        for _ in range(group):
            tokens = list(prompt)
            with torch.no_grad():
                for _ in range(length):
                    logits = model(torch.tensor([tokens])).logits[0, -1].float() / TEMPERATURE
                    tokens.append(int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)))
            completion = tokens[len(prompt) :]
            stub = Rollout(prompt, completion, [0.0] * length, index)
            with torch.no_grad():
                logprobs, _, _ = token_logprobs(model, [stub], TEMPERATURE)
            rollouts.append(Rollout(prompt, completion, logprobs[0].tolist(), index))
    return rollouts


def test_reward_rises_on_the_tiny_task(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(create_tiny_llama(tmp_path / "model"), dtype=torch.float32)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    objective = Objective(
        algorithm="grpo",
        learning_rate=3e-3,
        truncated_importance_sampling=TruncatedImportanceSampling(enabled=True, cap=2.0),
    )
    reward = load_reward("lockstep_workers.rewards:target_words")
    assert reward is target_words
    prompts = [[1, 10, 11], [1, 20, 21], [1, 30, 31], [1, 40, 41]]
    history = []
    for _ in range(25):
        rollouts = sample(model, prompts, group=6, length=6)
        metrics = learn(
            model, optimizer, rollouts, [reward(r.prompt, r.completion) for r in rollouts], objective, TEMPERATURE
        )
        history.append(metrics)
        assert metrics["mean_abs_logprob_diff"] < 1e-4, "trainer and sampler agree exactly here"
    first, last = sum(m["reward"] for m in history[:5]) / 5, sum(m["reward"] for m in history[-5:]) / 5
    print(f"mean reward over the first 5 steps {first:.3f}, over the last 5 {last:.3f}")
    assert last > first + 0.2, f"reward {first:.3f} -> {last:.3f}"


def test_mismatch_is_measured_on_sequences_sampled_wholly_under_the_trainers_version(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(create_tiny_llama(tmp_path / "model"), dtype=torch.float32)
    [exact] = sample(model, [[1, 10, 11]], group=1, length=4)
    off = [lp - 0.5 for lp in exact.logprobs]  # as if sampled under other weights
    rollouts = [
        Rollout(exact.prompt, exact.completion, exact.logprobs, 0, [3, 3, 3, 3]),
        Rollout(exact.prompt, exact.completion, off, 0, [2, 2, 3, 3]),  # spans an update: KV from version 2
    ]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    metrics = learn(model, optimizer, rollouts, [0.0, 1.0], Objective(minibatches=1), TEMPERATURE, version=3)
    assert metrics["onpolicy_mean_abs_logprob_diff"] < 1e-5, "only the first sequence counts"
    assert metrics["mean_abs_logprob_diff"] > 0.2, "over all tokens the second sequence's offset shows"
    assert metrics["onpolicy_token_fraction"] == 0.5
    assert metrics["spanning_sequence_fraction"] == 0.5
    assert metrics["lag"] == 1


def test_the_trainer_refuses_to_run_without_its_weights_directory(tmp_path: Path) -> None:
    from lockstep.api import Training
    from lockstep_workers.trainer import PodEnvironment, train

    env = PodEnvironment(0, 1, ["http://actors:8000"], None, {}, None, None, 0)
    with pytest.raises(SystemExit, match=r"LOCKSTEP_SHARED_DIR is not set: the operator sets it"):
        train(str(tmp_path), Training(reward="lockstep_workers.rewards:target_words"), env)


def test_the_trainers_top_p_mask_is_vllms() -> None:
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    from lockstep_workers.trainer import top_p_masked

    logits = torch.randn(64, 256, generator=torch.Generator().manual_seed(5)) * 4
    for top_p in (0.5, 0.9, 0.99):
        expected = apply_top_k_top_p_pytorch(logits.clone(), None, torch.full((64,), top_p))
        assert torch.equal(top_p_masked(logits, top_p).isinf(), expected.isinf()), f"top_p={top_p}"


def test_a_restarted_trainer_resumes_from_the_committed_weights(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from lockstep_workers.trainer import resume
    from lockstep_workers.weights import publish

    directory = create_tiny_llama(tmp_path / "model")
    trained = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        for parameter in trained.parameters():
            parameter.add_(0.1)
    committed = publish(trained.state_dict(), tmp_path / "weights", version=7)
    fresh = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    assert resume(fresh, None, tmp_path / "nothing-published") == 1
    announced = committed.model_copy(update={"uri": "http://trainer:9500/weights/7"})  # a collective backend's
    assert resume(fresh, announced, tmp_path / "weights") == 8, "the trainer resumes from its own files"
    expected = trained.state_dict()
    assert all(torch.equal(tensor, expected[name]) for name, tensor in fresh.state_dict().items())
    with pytest.raises(SystemExit, match=r"set spec\.weightSync\.volume so that a restarted trainer finds"):
        resume(fresh, committed, tmp_path / "lost-with-its-pod")

    with torch.no_grad():
        for parameter in trained.parameters():
            parameter.add_(0.1)
    publish(trained.state_dict(), tmp_path / "weights", version=8)  # announced; its update may be in flight
    assert resume(fresh, committed, tmp_path / "weights") == 9, "version 8 keeps naming the weights announced as 8"
    expected = trained.state_dict()
    assert all(torch.equal(tensor, expected[name]) for name, tensor in fresh.state_dict().items())


def test_tied_weights_are_published_once_as_hugging_face_writes_them(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from lockstep_workers.weights import local_path, publish

    embedding = torch.randn(8, 4)
    weights = publish({"model.embed_tokens.weight": embedding, "lm_head.weight": embedding}, tmp_path, version=1)
    assert set(load_file(str(local_path(weights)))) == {"model.embed_tokens.weight"}
