"""The trainer: a tiny random model learns the demo task with ``learn``; the chunked head and micro-batches compute
what one pass over the full logits does; sharded over 2 ranks (FSDP2 over gloo) it trains as 1 rank does; a trainer
stopped between steps and restarted, with another number of ranks, goes on from its checkpoint as if never stopped."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import random
import socket
import sys
import time
from collections.abc import Sequence
from copy import deepcopy
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
import torch.multiprocessing as mp

from lockstep.api import (
    Dataset,
    DType,
    Evaluation,
    LoraSettings,
    MismatchBudget,
    MlflowTracking,
    ModelSource,
    Objective,
    OptimizerSettings,
    Output,
    Overlong,
    RolloutCorrection,
    Tracking,
    TrainerNumerics,
    Training,
    VllmSettings,
    WeightUpdateSemantics,
)
from lockstep.podconfig import PodConfig
from lockstep_workers.rewards import target_words
from lockstep_workers.rollout.client import Rows
from lockstep_workers.rollout.record import Rollout
from lockstep_workers.rollout.scoring import load_callable
from lockstep_workers.tiny_model import create_tiny_llama
from lockstep_workers.tiny_models import FAMILIES, create_tiny_model, family
from lockstep_workers.trainer import learner
from lockstep_workers.trainer.learner import Policy, learn, token_logprobs
from lockstep_workers.trainer.loop import _publish_and_announce
from lockstep_workers.trainer.objective import Statistics
from lockstep_workers.trainer.optimization import NonFiniteGradients, SkippedSteps
from lockstep_workers.trainer.pod import PodEnvironment
from lockstep_workers.trainer.routing import EXPERT_LOAD_IMBALANCE, ROUTING_MISMATCH, TOKENS_DROPPED
from lockstep_workers.trainer.shaping import masked_if_cut
from lockstep_workers.weights import lora
from lockstep_workers.weights.files import StreamedPublish

TEMPERATURE = 1.0
RANKS = "forkserver"
"""How the tests start trainer ranks: each forked from one server process that imported the trainer, transformers'
modeling and this module once (multiprocessing's forkserver), rather than spawned as a fresh interpreter that imports
them again (about 5 s a rank). Each rank is still a process of its own, as a pod's is."""
mp.set_forkserver_preload(["lockstep_workers.trainer.loop", "transformers.models.llama.modeling_llama", __name__])


def sample(model: torch.nn.Module, prompts: list[list[int]], group: int, length: int) -> list[Rollout]:
    """Sample ``group`` completions of each prompt from the model itself (a stand-in for the actors), with their
    logprobs. Prompts of one length are sampled together, one batched forward pass a token: token by token, one
    sequence at a time, the forward passes' overhead made the LoRA-against-full test several minutes long."""
    rollouts: dict[tuple[int, int], Rollout] = {}
    generator = torch.Generator().manual_seed(len(prompts) * 1000 + group)
    for size in sorted({len(p) for p in prompts}):
        chosen = [index for index, prompt in enumerate(prompts) if len(prompt) == size]
        rows = [(index, n) for index in chosen for n in range(group)]
        tokens = torch.tensor([prompts[index] for index, _ in rows])
        with torch.no_grad():
            for _ in range(length):
                logits = model(tokens).logits[:, -1].float() / TEMPERATURE
                drawn = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)
                tokens = torch.cat([tokens, drawn], dim=1)
        completions = tokens[:, size:].tolist()
        stubs = [
            Rollout(prompts[index], c, [0.0] * length, index) for (index, _), c in zip(rows, completions, strict=True)
        ]
        with torch.no_grad():
            logprobs, _, _ = token_logprobs(Policy(model), stubs, TEMPERATURE)
        for row, (key, stub) in enumerate(zip(rows, stubs, strict=True)):
            rollouts[key] = Rollout(stub.prompt, stub.completion, logprobs[row].tolist(), stub.group)
    return [rollouts[index, n] for index in range(len(prompts)) for n in range(group)]


def tiny(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(create_tiny_llama(path), dtype=torch.float32)


def test_reward_rises_on_the_tiny_task(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = tiny(tmp_path / "model")
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    objective = Objective(
        algorithm="grpo",
        learning_rate=3e-3,
        rollout_correction=RolloutCorrection(upper=2.0),
    )
    reward = load_callable("lockstep_workers.rewards:target_words")
    assert reward is target_words
    prompts = [[1, 10, 11], [1, 20, 21], [1, 30, 31], [1, 40, 41]]
    history = []
    for _ in range(25):
        rollouts = sample(model, prompts, group=6, length=6)
        rewards = [reward(r.prompt, r.completion) for r in rollouts]
        metrics = learn(Policy(model), optimizer, rollouts, rewards, objective, TEMPERATURE)
        history.append(metrics)
        assert metrics["mean_abs_logprob_diff"] < 1e-4, "trainer and sampler agree exactly here"
    first, last = sum(m["reward"] for m in history[:5]) / 5, sum(m["reward"] for m in history[-5:]) / 5
    print(f"mean reward over the first 5 steps {first:.3f}, over the last 5 {last:.3f}")
    assert last > first + 0.2, f"reward {first:.3f} -> {last:.3f}"


def tiny_task_rewards(
    directory: Path, adapter: LoraSettings | None, learning_rate: float, steps: int = 16
) -> list[float]:
    """Each step's mean reward as the tiny model learns the target-words task from its own samples (8 prompts x 8
    completions of 8 tokens, GRPO), every weight trained, or only ``adapter`` (spec.trainer.lora)."""
    torch.manual_seed(0)
    model = tiny(directory)
    if adapter is not None:
        lora.inject(model, lora.adapter_config(adapter, model))
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=learning_rate)
    objective = Objective(learning_rate=learning_rate, rollout_correction=RolloutCorrection(upper=2.0))
    prompts = [[1, 10 * n, 10 * n + 1] for n in range(1, 9)]
    rewards = []
    for _ in range(steps):
        rollouts = sample(model, prompts, group=8, length=8)
        scores = [target_words(r.prompt, r.completion) for r in rollouts]
        rewards.append(learn(Policy(model), optimizer, rollouts, scores, objective, TEMPERATURE)["reward"])
    return rewards


def test_a_lora_adapter_learns_the_tiny_task_within_the_steps_full_fine_tuning_takes(tmp_path: Path) -> None:
    """spec.trainer.lora against full fine-tuning, 16 steps each, each at its own learning rate (an adapter starts
    at zero and takes a larger one). The task asks for particular tokens, so the adapter needs the lm_head too
    (trainLmHead; on the decoder layers alone it stayed near 0.17 here). Prints both curves and the difference."""
    full = tiny_task_rewards(tmp_path / "full", None, 3e-3)
    adapter = tiny_task_rewards(tmp_path / "lora", LoraSettings(rank=8, alpha=16, train_lm_head=True), 1e-2)
    last = {name: sum(curve[-3:]) / 3 for name, curve in (("full", full), ("lora", adapter))}
    print(f"full fine-tuning: {' '.join(f'{r:.2f}' for r in full)}")
    print(f"LoRA r8 + lm_head: {' '.join(f'{r:.2f}' for r in adapter)}")
    difference = last["lora"] - last["full"]
    print(f"over the last 3 of 16 steps: full {last['full']:.3f}, LoRA {last['lora']:.3f} ({difference:+.3f})")
    assert last["full"] > full[0] + 0.2, "full fine-tuning learns the task"
    assert last["lora"] >= last["full"] - 0.1, f"the adapter falls short of full fine-tuning by more than 0.1: {last}"


def test_the_chunked_head_scores_tokens_as_the_full_logits_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Slices of 5 tokens, with gradient (recomputed in the backward pass) and without, top-p included: the same
    logprobs, entropies and gradients as log-softmax over the whole batch's logits."""
    model = tiny(tmp_path / "model")
    rollouts = [
        Rollout([1, 10, 11], [20, 30, 40, 50], [0.0] * 4, 0),
        Rollout([1, 12], [21, 31, 41, 51, 61, 71, 81], [0.0] * 7, 1),
    ]
    for top_p in (1.0, 0.9):
        ids = torch.tensor([[1, 10, 11, 20, 30, 40, 50, 0, 0], [1, 12, 21, 31, 41, 51, 61, 71, 81]])
        attention = torch.tensor([[1] * 7 + [0] * 2, [1] * 9])
        logits = model(ids, attention_mask=attention).logits.float() / TEMPERATURE
        scores = learner.top_p_masked(logits, top_p).log_softmax(-1) if top_p < 1 else logits.log_softmax(-1)
        expected = [scores[0, 2:6].gather(1, torch.tensor([[20], [30], [40], [50]]))[:, 0]]
        expected.append(scores[1, 1:8].gather(1, torch.tensor([[21], [31], [41], [51], [61], [71], [81]]))[:, 0])
        entropy = -(scores.exp() * scores.nan_to_num(neginf=0.0)).sum(-1)
        reference = torch.autograd.grad(sum(e[e.isfinite()].sum() for e in expected), model.lm_head.weight)[0]

        monkeypatch.setattr(learner, "HEAD_CHUNK_TOKENS", 5)
        with torch.no_grad():
            logprobs, entropies, mask = token_logprobs(
                Policy(model), rollouts, TEMPERATURE, top_p=top_p, with_entropy=True
            )
        assert entropies is not None and mask.sum() == 11
        torch.testing.assert_close(logprobs[0, :4], expected[0].detach())
        torch.testing.assert_close(logprobs[1], expected[1].detach())
        torch.testing.assert_close(entropies[0, :4], entropy[0, 2:6].detach())
        with_grad, _, _ = token_logprobs(Policy(model), rollouts, TEMPERATURE, top_p=top_p)
        (gradient,) = torch.autograd.grad(with_grad[with_grad.isfinite() & mask.bool()].sum(), model.lm_head.weight)
        torch.testing.assert_close(gradient, reference)
        if top_p < 1:
            assert logprobs.isinf().any(), "some sampled tokens fall outside top-p 0.9 of a random model"


def test_the_head_soft_caps_the_logits_as_the_models_own_forward_does(tmp_path: Path) -> None:
    """Gemma 2's final_logit_softcapping (the tiny model's 0.5, which its logits reach): the scored tokens'
    logprobs, with gradient and without, are the log-softmax of the model's own (capped) logits; vLLM's logits
    processor caps them the same way."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(create_tiny_model(family("gemma2"), tmp_path / "gemma2")).eval()
    assert model.config.final_logit_softcapping == 0.5
    rollout = Rollout([1, 10, 11], [20, 30, 40, 50], [0.0] * 4, 0)
    logits = model(torch.tensor([rollout.prompt + rollout.completion])).logits.float() / TEMPERATURE
    expected = logits.log_softmax(-1)[0, 2:6].gather(1, torch.tensor([[20], [30], [40], [50]]))[:, 0].detach()
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            logprobs, _, _ = token_logprobs(Policy(model), [rollout], TEMPERATURE)
        torch.testing.assert_close(logprobs[0].detach(), expected)


def test_micro_batches_accumulate_the_gradient_of_one_pass(tmp_path: Path) -> None:
    model = tiny(tmp_path / "model")
    rollouts = sample(model, [[1, 10, 11], [1, 20, 21]], group=4, length=5)
    rewards = [target_words(r.prompt, r.completion) for r in rollouts]
    trained = {}
    for tokens in (None, 16):
        copy = tiny(tmp_path / "model")
        optimizer = torch.optim.SGD(copy.parameters(), lr=1.0)
        for algorithm in ("ppo", "grpo", "gspo"):
            objective = Objective(algorithm=algorithm, minibatches=1, tokens_per_micro_batch=tokens)
            learn(Policy(copy), optimizer, rollouts, rewards, objective, TEMPERATURE)
        trained[tokens] = copy.state_dict()
    assert len(learner.micro_batches(range(8), rollouts, 16, torch.device("cpu"))) == 4
    for name, tensor in trained[None].items():
        torch.testing.assert_close(trained[16][name], tensor, rtol=1e-5, atol=1e-6)
    assert any(not torch.equal(t, model.state_dict()[n]) for n, t in trained[None].items()), "the steps moved"


UNCLIPPED = OptimizerSettings(max_grad_norm=0.0)
OBJECTIVES: list[dict[str, Any]] = [
    {"algorithm": "ppo"},
    {"algorithm": "grpo"},
    {"algorithm": "gspo"},
    {
        "algorithm": "grpo",
        "advantage": "rloo",
        "loss_aggregation": "seq-mean-token-sum-norm",
        "entropy_coefficient": 0.1,
    },
    {"algorithm": "gspo", "advantage": "dr_grpo", "loss_aggregation": "token-mean", "entropy_coefficient": 0.1},
    {"algorithm": "ppo", "advantage": "reinforce_plus_plus"},
]
"""Today's three algorithms, and issue 34's estimators, aggregations and entropy bonus."""


def test_the_step_metrics_are_the_same_for_any_micro_batch_size_and_number_of_ranks(tmp_path: Path) -> None:
    """Issue 24 item 1: micro-batches of 8 tokens measure what one pass does (the same gradient, so the same
    second minibatch); 2 or 3 ranks, each learning from its own prompt groups, their statistics added as
    ``across_ranks`` adds them, measure what one rank does with the whole batch (no step: learning rate 0); for
    every objective in OBJECTIVES (REINFORCE++ whitens over every rank's tokens, a collective that the ranks
    simulated here, each learning alone, do not share: its ranks are checked by the micro-batches alone)."""
    model = tiny(tmp_path / "model")
    prompts = [[1, 10, 11], [1, 20, 21], [1, 30, 31], [1, 40, 41], [1, 50, 51], [1, 60, 61]]
    rollouts = sample(model, prompts, group=2, length=5)
    noise = random.Random(0)
    rollouts = [
        Rollout(r.prompt, r.completion, [lp + noise.gauss(0, 0.5) for lp in r.logprobs], r.group) for r in rollouts
    ]
    rewards = [1.0, 1.0] + [float(n % 2) for n in range(10)]  # the first group's rewards are all equal
    correction = RolloutCorrection(level="sequence", mode="mask", upper=3.0, veto=0.05)
    for variant in OBJECTIVES:
        measured = {}
        for tokens in (None, 8):
            objective = Objective(
                **variant,
                minibatches=2,
                tokens_per_micro_batch=tokens,
                rollout_correction=correction,
                optimizer=UNCLIPPED,  # SGD's one step at rate 1 moves the ratios beyond the clip range
            )
            copy = tiny(tmp_path / "model")
            optimizer = torch.optim.SGD(copy.parameters(), lr=1.0)
            measured[tokens] = learn(
                Policy(copy), optimizer, rollouts, rewards, objective, 1.0, version=0, max_tokens=5
            )
        one_pass = Statistics.from_floats(measured[None]).metrics()
        # reinforce_plus_plus has no group baseline: the equal-reward group has an advantage there
        equal_groups_without_advantage = 0 if variant.get("advantage") == "reinforce_plus_plus" else 1
        assert one_pass["zero_advantage_groups"] == equal_groups_without_advantage
        assert one_pass["clamp_log_ratio_new_old_indicator"] > 0
        assert 0 < one_pass["rollout_is_masked_fraction"] < 1, "the mask acts on some sequences here"
        assert Statistics.from_floats(measured[8]).metrics() == pytest.approx(one_pass, rel=1e-4, abs=1e-6)
        if variant.get("advantage") == "reinforce_plus_plus":
            continue
        objective = Objective(**variant, minibatches=2, tokens_per_micro_batch=8, rollout_correction=correction)
        frozen = torch.optim.SGD(model.parameters(), lr=0.0)
        whole = learn(Policy(model), frozen, rollouts, rewards, objective, 1.0, version=0, max_tokens=5)
        for world in (2, 3):
            ranks = Statistics()
            for rank in range(world):
                mine = [n for n, r in enumerate(rollouts) if r.group % world == rank]
                shard = learn(
                    Policy(model),
                    frozen,
                    [rollouts[n] for n in mine],
                    [rewards[n] for n in mine],
                    objective,
                    1.0,
                    version=0,
                    max_tokens=5,
                )
                ranks += Statistics.from_floats(shard)
            # Not the gradient's norm: FSDP reduces the gradients over real ranks (test_two_ranks_train_as_one_does).
            combined, alone = ranks.metrics(), Statistics.from_floats(whole).metrics()
            assert combined.pop("grad_norm") > 0 and alone.pop("grad_norm") > 0
            assert combined == pytest.approx(alone, rel=1e-5, abs=1e-6)
        assert learner.across_ranks(whole, torch.device("cpu")) == Statistics.from_floats(whole).metrics()


def test_mismatch_is_measured_on_sequences_sampled_wholly_under_the_trainers_version(tmp_path: Path) -> None:
    model = tiny(tmp_path / "model")
    [exact] = sample(model, [[1, 10, 11]], group=1, length=4)
    off = [lp - 0.5 for lp in exact.logprobs]  # as if sampled under other weights
    rollouts = [
        Rollout(exact.prompt, exact.completion, exact.logprobs, 0, [3, 3, 3, 3]),
        Rollout(exact.prompt, exact.completion, off, 0, [2, 2, 3, 3]),  # spans an update: KV from version 2
    ]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    metrics = learn(Policy(model), optimizer, rollouts, [0.0, 1.0], Objective(minibatches=1), TEMPERATURE, version=3)
    assert metrics["onpolicy_mean_abs_logprob_diff"] < 1e-5, "only the first sequence counts"
    assert metrics["mean_abs_logprob_diff"] > 0.2, "over all tokens the second sequence's offset shows"
    assert metrics["onpolicy_token_fraction"] == 0.5
    assert metrics["spanning_sequence_fraction"] == 0.5
    assert metrics["staleness"] == 1


def test_a_sample_older_than_max_lag_never_reaches_the_loss(tmp_path: Path) -> None:
    """The producer drops such samples before (rollout/test_producer.py); ``learn`` refuses any that get through."""
    model = tiny(tmp_path / "model")
    [fresh] = sample(model, [[1, 10, 11]], group=1, length=4)
    stale = Rollout(fresh.prompt, fresh.completion, fresh.logprobs, 0, [3, 4, 5, 5])
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    with pytest.raises(ValueError, match=r"1 rollout\(s\) up to 2 versions behind weights version 5, more than "):
        learn(Policy(model), optimizer, [fresh, stale], [0.0, 1.0], Objective(), TEMPERATURE, version=5, max_lag=1)
    assert all(torch.equal(tensor, before[name]) for name, tensor in model.state_dict().items()), "no step taken"


def test_a_step_whose_gradient_is_not_finite_is_skipped_and_too_many_in_a_row_stop_the_trainer(tmp_path: Path) -> None:
    """Issue 46 item 5: a finite loss whose backward overflows (here a hook makes one gradient infinite) no longer
    steps AdamW, which wrote NaN into the weights: both minibatches are skipped and counted, the weights are the
    ones the step started from; the next finite step learns; the limit in a row raises NonFiniteGradients."""
    model = tiny(tmp_path / "model")
    rollouts = sample(model, [[1, 10, 11], [1, 20, 21]], group=2, length=4)
    rewards = [0.0, 1.0, 1.0, 0.0]
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    overflow = model.lm_head.weight.register_hook(lambda gradient: gradient * math.inf)
    skipped = SkippedSteps()
    metrics = learn(Policy(model), optimizer, rollouts, rewards, Objective(minibatches=2), TEMPERATURE, skipped=skipped)
    assert math.isfinite(metrics["loss"]) and metrics["skipped_optimizer_steps"] == 2.0 and skipped.in_a_row == 2
    assert metrics["grad_norm"] == 0.0, "no step taken: none averaged"
    assert all(torch.equal(tensor, before[name]) for name, tensor in model.state_dict().items()), "no weight moved"
    overflow.remove()
    metrics = learn(Policy(model), optimizer, rollouts, rewards, Objective(minibatches=2), TEMPERATURE, skipped=skipped)
    assert metrics["skipped_optimizer_steps"] == 0.0 and skipped.in_a_row == 0 and metrics["grad_norm"] > 0
    assert all(t.isfinite().all() for t in model.state_dict().values())
    assert any(not torch.equal(t, before[n]) for n, t in model.state_dict().items()), "the finite step learned"
    model.lm_head.weight.register_hook(lambda gradient: gradient * math.nan)
    with pytest.raises(NonFiniteGradients, match="2 optimiser steps in a row had gradient norm nan"):
        learn(
            Policy(model),
            optimizer,
            rollouts,
            rewards,
            Objective(minibatches=2),
            TEMPERATURE,
            skipped=SkippedSteps(limit=2),
        )


def test_zero_advantage_groups_are_those_without_advantage_under_each_estimator(tmp_path: Path) -> None:
    """Issue 46 item 6: a group whose rewards are all equal has no advantage under grpo, but under reinforce_plus_plus
    (no group baseline) it has one, its reward against the step's mean: the metric counted it as having none."""
    model = tiny(tmp_path / "model")
    rollouts = sample(model, [[1, 10, 11], [1, 20, 21]], group=2, length=4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    found = {
        estimator: learn(
            Policy(model), optimizer, rollouts, [1.0, 1.0, 0.0, 1.0], Objective(advantage=estimator), TEMPERATURE
        )["zero_advantage_groups"]
        for estimator in ("grpo", "reinforce_plus_plus")
    }
    assert found == {"grpo": 1.0, "reinforce_plus_plus": 0.0}


def test_a_step_that_skipped_optimiser_steps_says_so_in_the_trainers_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    env = PodEnvironment(0, 1, [], tmp_path, None, None, None, 0)
    metrics = {
        "reward": 0.5,
        "staleness": 0.0,
        "clamp_log_ratio_new_old_indicator": 0.0,
        "kl_new_old": 0.0,
        "ess": 1.0,
        "publish_gather_seconds": 0.0,
        "publish_wait_seconds": 0.0,
        "skipped_optimizer_steps": 2.0,
    }
    writing = StreamedPublish({"weight": torch.zeros(2)}, env.weights_dir, 3, keep=3)
    writing.put({"weight": torch.zeros(2)})
    writing.close()
    with caplog.at_level(logging.WARNING, logger="lockstep.trainer"):
        _publish_and_announce(
            env, Training(reward="lockstep_workers.rewards:target_words"), 3, writing, metrics, 1.0, 1.0
        )
    assert "step 3: 2 of its optimiser steps skipped, their gradient norm not finite" in caplog.text
    assert json.loads(env.metrics_file.read_text())["skipped_optimizer_steps"] == 2.0


def test_why_the_trainer_stops_is_its_termination_message_which_the_job_condition_quotes(tmp_path: Path) -> None:
    """Issue 46 item 5: the condition quoted the log's last line, which a warning printed at exit could be."""
    from lockstep.reconcile.restarts import termination_message
    from lockstep_workers.trainer.loop import write_termination_message

    mounted = tmp_path / "termination-log"
    mounted.touch()
    with pytest.raises(NonFiniteGradients) as stopped:
        SkippedSteps(limit=1).allows(math.nan)
    write_termination_message(stopped.value, mounted)
    said = mounted.read_text()
    assert said == f"lockstep_workers.trainer.optimization.NonFiniteGradients: {stopped.value}\n"
    pod = {"status": {"containerStatuses": [{"state": {"terminated": {"exitCode": 1, "message": said}}}]}}
    assert termination_message(pod) == said.strip(), "quoted whole"
    write_termination_message(SystemExit("spec.trainer.dataset: no such file"), mounted)
    assert mounted.read_text() == "spec.trainer.dataset: no such file\n"
    write_termination_message(stopped.value, tmp_path / "absent")
    assert not (tmp_path / "absent").exists(), "written only where the kubelet mounted the file"


def test_a_trainer_stopped_by_non_finite_gradients_exits_with_the_code_that_fails_the_job(tmp_path: Path) -> None:
    from lockstep.protocol import TRAINER_GAVE_UP_EXIT_CODE
    from lockstep_workers.trainer.loop import run_saying_why_it_stops

    mounted = tmp_path / "termination-log"
    mounted.touch()

    def diverging() -> None:
        SkippedSteps(limit=1).allows(math.inf)

    with pytest.raises(SystemExit) as stopped:
        run_saying_why_it_stops(diverging, mounted)
    assert stopped.value.code == TRAINER_GAVE_UP_EXIT_CODE
    assert "NonFiniteGradients: 1 optimiser steps in a row had gradient norm inf" in mounted.read_text()

    def refusing() -> None:
        raise SystemExit("spec.trainer.dataset: no such file")

    with pytest.raises(SystemExit) as refused:
        run_saying_why_it_stops(refusing, mounted)
    assert refused.value.code == "spec.trainer.dataset: no such file", "any other failure is restarted as before"
    assert mounted.read_text() == "spec.trainer.dataset: no such file\n"


def test_tokens_the_environment_inserted_stay_out_of_the_loss(tmp_path: Path) -> None:
    """Two copies of a batch whose environment tokens carry different rollout logprobs train alike; without the
    mask the difference would reach the loss (through the importance weights)."""
    model = tiny(tmp_path / "model")
    rollouts = sample(model, [[1, 10, 11], [1, 20, 21]], group=2, length=6)
    mask = [True, True, False, False, True, True]
    rewards = [0.0, 1.0, 1.0, 0.0]
    objective = Objective(algorithm="ppo", minibatches=1)
    trained = []
    for inserted in (0.0, -30.0):
        logprobs = [[lp if own else inserted for lp, own in zip(r.logprobs, mask, strict=True)] for r in rollouts]
        episodes = [Rollout(r.prompt, r.completion, lps, r.group) for r, lps in zip(rollouts, logprobs, strict=True)]
        for policy_mask in (mask, []):
            copy = tiny(tmp_path / "model")
            masked = [Rollout(r.prompt, r.completion, r.logprobs, r.group, [], policy_mask) for r in episodes]
            metrics = learn(Policy(copy), torch.optim.SGD(copy.parameters(), lr=1.0), masked, rewards, objective, 1.0)
            trained.append((copy.state_dict(), metrics["mean_abs_logprob_diff"]))
    (masked_zero, diff_zero), (_, unmasked_zero), (masked_far, diff_far), (_, unmasked_far) = trained
    for name, tensor in masked_zero.items():
        torch.testing.assert_close(masked_far[name], tensor)
    assert diff_zero == diff_far < 1e-4, "the environment's tokens are not measured either"
    assert unmasked_far > unmasked_zero + 5, "unmasked, the inserted tokens' logprobs would count"


def test_completions_cut_at_max_tokens_stay_out_of_the_loss_with_overlong_mask(tmp_path: Path) -> None:
    """spec.trainer.rollout.overlong mode mask: the cut completions' tokens do not reach the loss (what the rollout
    engine said of them changes nothing), and a batch cut whole takes no step."""
    model = tiny(tmp_path / "model")
    full = sample(model, [[1, 10, 11], [1, 20, 21]], group=2, length=6)
    rollouts = [
        replace(r, completion=r.completion[:4], logprobs=r.logprobs[:4]) if n % 2 else r for n, r in enumerate(full)
    ]
    rewards, objective, mask = [0.0, 1.0, 1.0, 0.0], Objective(algorithm="grpo", minibatches=1), Overlong(mode="mask")
    trained = []
    for shift in (0.0, -30.0):
        batch = [
            replace(r, logprobs=[lp + shift for lp in r.logprobs]) if len(r.completion) == 6 else r for r in rollouts
        ]
        copy = deepcopy(model)
        learn(
            Policy(copy),
            torch.optim.SGD(copy.parameters(), lr=1.0),
            masked_if_cut(batch, 6, mask),
            rewards,
            objective,
            1.0,
        )
        trained.append(copy.state_dict())
    for name, tensor in trained[0].items():
        torch.testing.assert_close(trained[1][name], tensor)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    metrics = learn(
        Policy(model),
        torch.optim.SGD(model.parameters(), lr=1.0),
        masked_if_cut(rollouts, 4, mask),
        rewards,
        objective,
        1.0,
    )
    assert metrics["loss"] == 0.0 and all(torch.equal(t, before[n]) for n, t in model.state_dict().items())


def test_dynamic_sampling_the_overlong_penalty_and_weighted_rewards_reach_the_steps_metrics(tmp_path: Path) -> None:
    """The trainer wires them: each step's reward is the weighted sum of its functions' means plus the mean penalty
    (the scripted actors' completions are 6 tokens: -0.5 under maxTokens 8 and a window of 4), and dynamic
    sampling reports what it dropped and sampled beyond promptsPerStep."""
    settings = Training.model_validate(
        {
            **SETTINGS.model_dump(by_alias=True, exclude={"reward"}),
            "checkpointEverySteps": 0,
            "rewards": [
                {"name": "target", "function": "lockstep_workers.rewards:target_words"},
                {"name": "half", "function": "lockstep_workers.rewards:target_words", "weight": 0.5},
            ],
            "rollout": {
                **SETTINGS.rollout.model_dump(by_alias=True, exclude_none=True),
                "maxTokens": 8,
                "dynamicSampling": True,
                "maxExtraGroups": 2,
                "overlong": {"mode": "penalty", "window": 4},
            },
        }
    )
    records = run_trainer(1, create_tiny_llama(tmp_path / "model"), tmp_path / "shared", 2, settings)
    for record in records:
        assert record["overlong_penalty"] == -0.5 and record["truncated_fraction"] == 0.0
        assert record["rewards/target"] == pytest.approx(record["rewards/half"])
        assert record["reward"] == pytest.approx(1.5 * record["rewards/target"] - 0.5)
        assert record["extra_groups"] == min(record["dropped_groups"] + record["unfilled_groups"], 2)


def test_the_rollout_function_is_an_async_function_named_by_the_spec() -> None:
    from lockstep_workers.episodes import single_turn
    from lockstep_workers.trainer.sampling import load_rollout_function

    assert load_rollout_function(None) is single_turn
    assert load_rollout_function("lockstep_workers.episodes:single_turn") is single_turn
    with pytest.raises(ValueError, match=r"'lockstep_workers.rewards:target_words' is not an async function"):
        load_rollout_function("lockstep_workers.rewards:target_words")


def test_the_trainer_refuses_to_run_without_its_weights_directory(tmp_path: Path) -> None:
    from lockstep_workers.rollout.client import ActorService, FixedActors
    from lockstep_workers.trainer.loop import train

    env = PodEnvironment(0, 1, ["http://actors:8000"], None, None, None, None, 0)
    actors = ActorService(FixedActors(env.actors))
    with pytest.raises(SystemExit, match=r"LOCKSTEP_SHARED_DIR is not set: the operator sets it"):
        train(str(tmp_path), Training(reward="lockstep_workers.rewards:target_words"), env, actors)


def test_the_trainers_top_p_mask_is_vllms() -> None:
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    logits = torch.randn(64, 256, generator=torch.Generator().manual_seed(5)) * 4
    for top_p in (0.5, 0.9, 0.99):
        expected = apply_top_k_top_p_pytorch(logits.clone(), None, torch.full((64,), top_p))
        assert torch.equal(learner.top_p_masked(logits, top_p).isinf(), expected.isinf()), f"top_p={top_p}"


def test_a_restarted_trainer_resumes_from_its_newest_weights_and_checkpoint(tmp_path: Path) -> None:
    from lockstep_workers.trainer.model import Resumption, resumption
    from lockstep_workers.weights.files import publish, version_path
    from lockstep_workers.weights.files import published as announcement_of

    model = tiny(tmp_path / "model")
    weights, checkpoints = tmp_path / "weights", tmp_path / "checkpoints"
    assert resumption(None, tmp_path / "nothing-published", checkpoints) == Resumption(1)
    committed = publish(model.state_dict(), weights, version=7)
    assert announcement_of(weights, 7) == committed, "a resumed trainer announces a version as it was announced"
    announced = committed.model_copy(update={"uri": "http://trainer:9500/weights/7"})  # a collective backend's
    assert resumption(announced, weights, checkpoints) == Resumption(8, version_path(weights, 7)), "its own files"
    with pytest.raises(SystemExit, match=r"set spec\.weightSync\.volume so that a restarted trainer finds"):
        resumption(committed, tmp_path / "lost-with-its-pod", checkpoints)

    (checkpoints / "step-000007").mkdir(parents=True)
    assert resumption(committed, weights, checkpoints).checkpoint is None, "an incomplete checkpoint is not loaded"
    (checkpoints / "step-000007" / ".metadata").touch()
    assert resumption(committed, weights, checkpoints) == Resumption(8, None, 7), "the checkpoint holds version 7"
    publish(model.state_dict(), weights, version=8)  # its announcement may have been lost with the old pod
    (weights / ".v000009.safetensors.partial").write_bytes(b"\0" * 64)  # killed while writing version 9
    assert resumption(committed, weights, checkpoints) == Resumption(
        9, version_path(weights, 8), 7, announce_again=announcement_of(weights, 8)
    ), "version 8 keeps naming the weights published as 8, announced again; the optimizer state comes from step 7"
    assert resumption(None, weights, checkpoints).announce_again == announcement_of(weights, 8), "none committed"


def test_tied_weights_are_published_once_as_hugging_face_writes_them(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from lockstep_workers.weights.files import local_path, publish

    embedding = torch.randn(8, 4)
    weights = publish({"model.embed_tokens.weight": embedding, "lm_head.weight": embedding}, tmp_path, version=1)
    assert set(load_file(str(local_path(weights)))) == {"model.embed_tokens.weight"}


@pytest.mark.parametrize("name", [f.name for f in FAMILIES if f.mixture_of_experts])
def test_experts_are_published_under_their_checkpoint_names_and_resume_in_the_models_own(
    tmp_path: Path, name: str
) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from lockstep_workers.trainer import sharding
    from lockstep_workers.weights.files import local_path, publish

    directory = create_tiny_model(family(name), tmp_path / "model")
    causal_lm = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    held = set(causal_lm.state_dict())
    assert any(key.endswith("experts.gate_up_proj") for key in held), "transformers holds the experts fused"
    published = load_file(str(local_path(publish(sharding.full_state_dict(causal_lm), tmp_path / "w", version=1))))
    saved = load_file(str(directory / "model.safetensors"))
    assert set(published) == set(saved), "the names save_pretrained writes, one tensor per expert and projection"
    assert all(torch.equal(published[key], saved[key]) for key in saved)
    with torch.no_grad():
        for parameter in causal_lm.parameters():
            parameter.add_(torch.randn_like(parameter))
    weights = publish(sharding.full_state_dict(causal_lm), tmp_path / "w", version=2)
    resumed = sharding.memory_names(causal_lm, local_path(weights))
    assert set(resumed) == held
    assert all(torch.equal(resumed[key], causal_lm.state_dict()[key]) for key in held), "read back bit-exact"


# -- the trainer's loop on 1 and 2 ranks (FSDP2 over gloo), against scripted actors ------------------------------


class ScriptedActors:
    """Actors whose completions depend on the prompt alone (the same batch for the same step, whatever the weights),
    that serve every version at once and report no busy time. The ``hold``th request (from 1) is never answered.
    With ``moe_layers``, each sample has routed experts as vLLM returns them (prompt + completion - 1 tokens, top-2
    of 4 experts in each layer), drawn from the prompt too."""

    def __init__(self, length: int = 6, vocabulary: int = 256, hold: int | None = None, moe_layers: int = 0) -> None:
        self.length = length
        self.vocabulary = vocabulary
        self.hold = hold
        self.moe_layers = moe_layers
        self.requests = 0

    def wait_until_ready(self) -> None:
        pass

    def wait_for_version(self, version: int) -> None:
        pass

    async def served_version(self) -> int:
        return sys.maxsize

    async def busy_seconds(self) -> dict[str, float]:
        return {}

    async def generate(
        self, prompts: Sequence[list[int]], group: int, sampling: dict[str, Any], rows: Rows = None
    ) -> list[Rollout]:
        self.requests += 1
        if self.requests == self.hold:
            await asyncio.Event().wait()
        rollouts = []
        for index, prompt in enumerate(prompts):
            words = random.Random(str(prompt))
            for _ in range(group):
                completion = [words.randrange(3, self.vocabulary) for _ in range(self.length)]
                rollouts.append(Rollout(list(prompt), completion, [-5.5] * self.length, index))
                if self.moe_layers:
                    tokens = len(prompt) + self.length - 1
                    routed = [[words.sample(range(4), 2) for _ in range(self.moe_layers)] for _ in range(tokens)]
                    rollouts[-1] = replace(rollouts[-1], routed_experts=torch.tensor(routed, dtype=torch.int16))
        return rollouts


SETTINGS = Training.model_validate(
    {
        "reward": "lockstep_workers.rewards:target_words",
        "checkpointEverySteps": 1,
        "checkpointsKept": 2,
        "rollout": {"promptsPerStep": 4, "samplesPerPrompt": 4},
        "objective": {
            "algorithm": "grpo",
            "learningRate": 0.003,
            "minibatches": 2,
            "tokensPerMicroBatch": 40,
            # Steps 1 and 2 warm up, then a cosine decay to 0.1 x: whatever spec.trainer.steps a run has, a resumed
            # run's step 3 follows a stopped run's step 2 at the rate of one that never stopped.
            "optimizer": {"warmupSteps": 2, "schedule": "cosine", "minLearningRateRatio": 0.1},
        },
    }
)


def gradient_fingerprint(parameters: Sequence[torch.Tensor]) -> list[list[float]]:
    """Per parameter, in order: the sum, the L2 norm and a seeded random projection of its gradient."""
    fingerprint = []
    for index, parameter in enumerate(parameters):
        assert parameter.grad is not None
        grad: Any = parameter.grad
        whole = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().double().flatten()
        projection = torch.randn(whole.numel(), generator=torch.Generator().manual_seed(index), dtype=torch.float64)
        fingerprint.append([float(whole.sum()), float(whole.norm()), float(whole @ projection)])
    return fingerprint


def _record_first_gradients(path: Path) -> None:
    """In this process, write the first optimizer step's gradient fingerprint to ``path`` (JSON)."""

    def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not path.exists():
            parameters = [p for group in optimizer.param_groups for p in group["params"]]
            path.write_text(json.dumps(gradient_fingerprint(parameters)))

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(hook)


def _rank(
    rank: int,
    world: int,
    port: int,
    model: str,
    shared: str,
    settings: Training,
    vocabulary: int,
    gradients: str | None = None,
    hold: int | None = None,
    config: PodConfig | None = None,
    moe_layers: int = 0,
) -> None:
    from lockstep_workers.trainer.loop import train
    from lockstep_workers.trainer.pod import PodEnvironment

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if gradients is not None:
        _record_first_gradients(Path(gradients))
    env = PodEnvironment(rank, world, ["scripted"], Path(shared), config, None, None, 0)
    train(model, settings, env, ScriptedActors(vocabulary=vocabulary, hold=hold, moe_layers=moe_layers))


def run_trainer(
    world: int,
    model: Path,
    shared: Path,
    steps: int,
    settings: Training = SETTINGS,
    vocabulary: int = 256,
    gradients: Path | None = None,
    output: Output | None = None,
    routing_replay: bool = False,
) -> list[dict[str, Any]]:
    """``steps`` steps (counted from where the job's directory ``shared`` left off) on ``world`` ranks; every
    step's record so far. ``gradients``: where rank 0 writes its first optimizer step's gradient fingerprint;
    ``output``: spec.output and ``routing_replay`` (of a model with 2 MoE layers, the actors returning routed
    experts), in a PodConfig of the policy's defaults, which compute as no PodConfig does."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    settings = settings.model_copy(update={"steps": steps})
    recorded = str(gradients) if gradients is not None else None
    config = None
    if output is not None or routing_replay:
        config = PodConfig(
            fingerprint="test",
            policy="default",
            model=ModelSource(uri=str(model), dtype=DType.AUTO),
            vllm=VllmSettings(),
            trainer=TrainerNumerics(),
            weight_update=WeightUpdateSemantics(),
            mismatch_budget=MismatchBudget(),
            routing_replay=routing_replay,
            training=settings,
            output=output,
        )
    moe_layers = 2 if routing_replay else 0
    spawned = (world, port, str(model), str(shared), settings, vocabulary, recorded, None, config, moe_layers)
    mp.start_processes(_rank, args=spawned, nprocs=world, start_method=RANKS)
    return [json.loads(line) for line in (shared / "metrics.jsonl").read_text().splitlines()]


def published(shared: Path, version: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from lockstep_workers.weights.files import version_path, weights_directory

    return load_file(str(version_path(weights_directory(shared), version)))


def checkpointed(shared: Path, step: int) -> dict[str, Any]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from lockstep_workers.trainer.checkpoint import checkpoints_directory, step_path

    flat = shared / f"step-{step}.pt"
    dcp_to_torch_save(step_path(checkpoints_directory(shared), step), flat)
    state: dict[str, Any] = torch.load(flat, weights_only=False)
    return state


def assert_same_weights(found: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert set(found) == set(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(found[name], tensor, rtol=1e-4, atol=1e-5, msg=name)


def assert_trained_alike(found: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], shared: Path) -> None:
    """Weights trained on another number of ranks than ``expected``'s run (whose directory is ``shared``): each tensor
    within a thousandth of how far that run moved it since version 1. Not elementwise: Adam divides each gradient by
    its own running scale, so a gradient at rounding level, summed in another order over 2 ranks, moves its weight
    visibly (5e-5 in two embedding rows of the tiny model, 1e-4 of the tensor's movement, on one machine's CPU and
    not on another's); a gradient lost or counted twice is off by a tenth of the movement or more."""
    assert set(found) == set(expected)
    start = published(shared, 1)
    for name, tensor in expected.items():
        off, moved = (found[name] - tensor).norm().item(), (tensor - start[name]).norm().item()
        assert off <= 1e-3 * moved, f"{name}: {off:.3g} from the other run's, which moved {moved:.3g} since version 1"


def test_two_ranks_train_as_one_does(tmp_path: Path) -> None:
    """FSDP2 over gloo, 2 ranks (each learning from its own prompt groups, in micro-batches) against 1 rank on the
    same batches: the same losses and the same weights after 3 steps."""
    model = create_tiny_llama(tmp_path / "model")
    one = run_trainer(1, model, tmp_path / "one", steps=3)
    two = run_trainer(2, model, tmp_path / "two", steps=3)
    assert [r["step"] for r in two] == [1, 2, 3]
    for record in one + two:  # what each publish cost the trainer, and the background write
        assert all(record[name] >= 0 for name in ("publish_gather_seconds", "publish_wait_seconds")), record
        assert record["publish_seconds"] > 0, record
    for mine, theirs in zip(two, one, strict=True):
        for name in ("loss", "reward", "kl_new_old", "entropy", "grad_norm", "learning_rate"):
            assert mine[name] == pytest.approx(theirs[name], rel=1e-4, abs=1e-6), (mine["step"], name)
    assert_trained_alike(published(tmp_path / "two", 3), published(tmp_path / "one", 3), tmp_path / "one")
    assert any(not torch.equal(t, published(tmp_path / "one", 1)[n]) for n, t in published(tmp_path / "one", 3).items())


def test_two_ranks_train_a_mixture_of_experts_as_one_does(tmp_path: Path) -> None:
    """The same on a tiny MoE (tiny_models' qwen3-moe: 4 experts, top-2, fused 3-D expert weights sharded with their
    decoder layer), replaying the actors' routings: the same losses and gradient norms, the same routing metrics, the
    same weights, every expert's trained; tokens dropped is null (this family drops none). (Without engine routings
    the mismatch is null: the MoE jobs of e2e/tests/test_rl_job.py; replay's effect on the loss: test_routing.py.)"""
    model = create_tiny_model(family("qwen3-moe"), tmp_path / "model")
    one = run_trainer(1, model, tmp_path / "one", steps=2, routing_replay=True)
    two = run_trainer(2, model, tmp_path / "two", steps=2, routing_replay=True)
    for mine, theirs in zip(two, one, strict=True):
        for name in ("loss", "reward", "kl_new_old", "entropy", "grad_norm", EXPERT_LOAD_IMBALANCE, ROUTING_MISMATCH):
            assert mine[name] == pytest.approx(theirs[name], rel=1e-4, abs=1e-6), (mine["step"], name)
        assert mine[TOKENS_DROPPED] is None
        assert 0.5 < mine[ROUTING_MISMATCH] < 1  # random routings: a top-2 set of 4 is the own one 1 time in 6
    assert_trained_alike(published(tmp_path / "two", 2), published(tmp_path / "one", 2), tmp_path / "one")
    start, trained = published(tmp_path / "one", 1), published(tmp_path / "two", 2)
    experts = [name for name in trained if ".mlp.experts." in name or ".mlp.gate." in name]
    assert len(experts) == 2 * (4 * 3 + 1)  # per layer, each expert's gate, up and down projections, and the router
    for name in experts:
        assert not torch.equal(trained[name], start[name]), f"{name} did not train in step 2"


def test_a_failed_background_publish_stops_the_trainer_with_its_error(tmp_path: Path) -> None:
    """The weights directory cannot be made (a file has its name): version 1's publish fails in the background, and
    the trainer stops with that error before it goes on (here at step 1's checkpoint, which waits for it)."""
    model = create_tiny_llama(tmp_path / "model")
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "weights").write_text("not a directory")
    with pytest.raises(mp.ProcessRaisedException, match=r"PublishFailed: publishing weights version 1 failed: "):
        run_trainer(1, model, shared, steps=3)
    assert not (shared / "metrics.jsonl").exists(), "no step was recorded as published"


def _gather_then_step(rank: int, model: str, out: str) -> None:
    """One rank: the full state dict, then an optimizer step; saves the state dict as gathered and after the step."""
    from transformers import AutoModelForCausalLM

    from lockstep_workers.trainer import sharding

    torch.set_num_threads(1)
    mesh = sharding.start(rank, 1, torch.device("cpu"))
    causal_lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    policy = sharding.shard(causal_lm, mesh, compute_dtype=torch.float32, fp32_head=True)
    whole = sharding.full_state_dict(causal_lm)
    gathered = {name: tensor.clone() for name, tensor in whole.items()}
    optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)
    for parameter in policy.parameters():
        parameter.grad = torch.ones_like(parameter)
    optimizer.step()
    torch.save({"gathered": gathered, "after": whole, "moved": sharding.full_state_dict(causal_lm)}, out)
    torch.distributed.destroy_process_group()


def test_the_gathered_weights_are_a_snapshot_the_next_step_leaves_alone(tmp_path: Path) -> None:
    """On one CPU rank the gathered tensors would be the live parameters: the background publish writes them while
    the next step's optimizer runs, so they must not change under it."""
    model = create_tiny_llama(tmp_path / "model")
    out = tmp_path / "results.pt"
    mp.start_processes(_gather_then_step, args=(str(model), str(out)), nprocs=1, start_method=RANKS)
    results = torch.load(out, weights_only=False)
    for name, tensor in results["gathered"].items():
        assert torch.equal(results["after"][name], tensor), name
    assert all(not torch.equal(results["moved"][n], t) for n, t in results["gathered"].items()), "the step moved"


def _learn_with_and_without_activation_checkpointing(rank: int, model: str, out: str) -> None:
    """One rank: the same learning step on the sharded model (bf16 layers, the fp32 head: the trainer's default),
    without and with activation checkpointing; saves each one's layer calls under autograd, the dtypes its
    attention's inputs had (hidden states and RoPE's cos) and its weights after the step."""
    from transformers import AutoModelForCausalLM

    from lockstep_workers.trainer import sharding

    torch.set_num_threads(1)
    mesh = sharding.start(rank, 1, torch.device("cpu"))
    results = {}
    for checkpointing in (False, True):
        causal_lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        rollouts = sample(causal_lm, [[1, 10, 11], [1, 20, 21]], group=4, length=5)
        rewards = [target_words(r.prompt, r.completion) for r in rollouts]
        calls: list[bool] = []
        dtypes: set[tuple[torch.dtype, torch.dtype]] = set()
        for layer in causal_lm.model.layers:  # a pre-hook: a recomputation may stop before the layer returns
            layer.register_forward_pre_hook(lambda *_, calls=calls: calls.append(torch.is_grad_enabled()))
            layer.self_attn.register_forward_pre_hook(
                lambda _, args, kwargs, dtypes=dtypes: dtypes.add(
                    (kwargs["hidden_states"].dtype, kwargs["position_embeddings"][0].dtype)
                ),
                with_kwargs=True,
            )
        policy = sharding.shard(
            causal_lm, mesh, compute_dtype=torch.bfloat16, fp32_head=True, activation_checkpointing=checkpointing
        )
        optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)
        learn(policy, optimizer, rollouts, rewards, Objective(algorithm="grpo", minibatches=1), TEMPERATURE)
        results[checkpointing] = {
            "calls": sum(calls),
            "dtypes": dtypes,
            "weights": sharding.full_state_dict(causal_lm),
        }
    torch.save(results, out)
    torch.distributed.destroy_process_group()


def test_activation_checkpointing_recomputes_each_layer_and_learns_the_same(tmp_path: Path) -> None:
    """spec.trainer.activationCheckpointing on the FSDP2-sharded model: every decoder layer runs again in the
    backward pass (its activations were not kept) on inputs cast to the layers' dtype as in the forward pass (torch
    2.11's FSDP2 left RoPE's cos and sin in fp32 there, which CUDA's attention refused; docs/benchmarks.md), and the
    step ends on the same weights as without."""
    model = create_tiny_llama(tmp_path / "model")
    out = tmp_path / "results.pt"
    mp.start_processes(
        _learn_with_and_without_activation_checkpointing, args=(str(model), str(out)), nprocs=1, start_method=RANKS
    )
    results = torch.load(out, weights_only=False)
    kept, recomputed = results[False], results[True]
    assert kept["calls"] > 0 and recomputed["calls"] == 2 * kept["calls"], (kept["calls"], recomputed["calls"])
    assert kept["dtypes"] == recomputed["dtypes"] == {(torch.bfloat16, torch.bfloat16)}, recomputed["dtypes"]
    assert_same_weights(recomputed["weights"], kept["weights"])
    base = tiny(tmp_path / "model").state_dict()
    assert any(not torch.equal(t, base[n]) for n, t in kept["weights"].items()), "the step moved the weights"


def test_a_full_fine_tuning_jobs_kl_reference_is_the_model_it_started_from_on_any_ranks_and_after_a_restart(
    tmp_path: Path,
) -> None:
    """spec.trainer.objective.klCoefficient without LoRA: a frozen copy of the model, sharded like the policy, is the
    reference. Each step's second minibatch learns after the first moved the policy, so every step's KL is above 0;
    2 ranks (the reference offloaded to host memory: klReferenceOffload) stopped after step 2 and 1 rank resuming to
    step 4 measure the KL a trainer that never stopped does: the reference stays the starting model (were it the
    resumed weights, steps 3 and 4 would measure far less: the KL grows about 0.027 a step here)."""
    model = create_tiny_llama(tmp_path / "model")
    settings = SETTINGS.model_copy(update={"objective": SETTINGS.objective.model_copy(update={"kl_coefficient": 0.05})})
    offloaded = settings.model_copy(
        update={"objective": settings.objective.model_copy(update={"kl_reference_offload": True})}
    )
    straight = run_trainer(1, model, tmp_path / "straight", steps=4, settings=settings)
    run_trainer(2, model, tmp_path / "resumed", steps=2, settings=offloaded)
    resumed = run_trainer(1, model, tmp_path / "resumed", steps=4, settings=settings)
    assert all(r["kl_ref"] > 0 for r in straight), [r["kl_ref"] for r in straight]
    for mine, theirs in zip(resumed, straight, strict=True):
        for name in ("loss", "kl_ref", "kl_loss"):
            assert mine[name] == pytest.approx(theirs[name], rel=1e-3, abs=1e-7), (mine["step"], name)


def test_a_trainer_stopped_between_steps_resumes_its_checkpoint_on_another_number_of_ranks(tmp_path: Path) -> None:
    """2 ranks run 2 steps and stop; 1 rank resumes from their checkpoint (model and optimizer shards, resharded)
    and runs steps 3 and 4 on the same batches as a trainer that never stopped, to the same weights and optimizer
    state. The checkpoints beyond the newest 2 are removed."""
    model = create_tiny_llama(tmp_path / "model")
    straight = run_trainer(1, model, tmp_path / "straight", steps=4)
    run_trainer(2, model, tmp_path / "resumed", steps=2)
    resumed = run_trainer(1, model, tmp_path / "resumed", steps=4)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4], "steps 3 and 4 after the restart"
    for mine, theirs in zip(resumed[2:], straight[2:], strict=True):
        for name in ("loss", "reward", "kl_new_old", "grad_norm", "learning_rate"):
            assert mine[name] == pytest.approx(theirs[name], rel=1e-4, abs=1e-6), (mine["step"], name)
    assert [r["learning_rate"] for r in straight] == pytest.approx([0.0015, 0.003, 0.00165, 0.0003])
    assert_trained_alike(published(tmp_path / "resumed", 4), published(tmp_path / "straight", 4), tmp_path / "straight")
    expected, found = checkpointed(tmp_path / "straight", 4), checkpointed(tmp_path / "resumed", 4)
    assert found["trainer"]["step"] == 4
    moments = expected["optimizer"]["state"]
    assert moments and set(found["optimizer"]["state"]) == set(moments)
    for name, state in moments.items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(found["optimizer"]["state"][name][key], state[key], rtol=1e-4, atol=1e-7)
    kept = sorted(p.name for p in (tmp_path / "resumed" / "checkpoints").iterdir())
    assert kept == ["step-000003", "step-000004"]


def recorded_rows(shared: Path) -> dict[int, list[str]]:
    """Each step's prompts, one per completion, as rollouts.jsonl recorded them (all of its records)."""
    steps: dict[int, list[str]] = {}
    for line in (shared / "rollouts.jsonl").read_text().splitlines():
        record = json.loads(line)
        steps.setdefault(record["step"], []).append(record["prompt"])
    return steps


def test_a_trainer_killed_with_rows_sampled_but_not_learned_resumes_without_skipping_or_repeating_one(
    tmp_path: Path,
) -> None:
    """maxLag 2: the producer samples two steps ahead. The actors never answer step 3's second group, so the
    trainer waits in step 3 with that step's other groups and step 4's sampled but not learned; it is killed
    (SIGKILL) there, once step 2 is recorded, and restarted: it learns steps 3 and 4 on the rows a trainer that
    never stopped learned, and no row of the epoch twice."""
    from lockstep_workers import text_task

    shipped = Path(__file__).resolve().parents[3] / "examples" / "datasets" / "larger"
    settings = SETTINGS.model_copy(
        update={
            "max_lag": 2,
            "checkpoint_every_steps": 0,
            "reward": "lockstep_workers.rewards:math_exact_match",
            "dataset": Dataset(train=str(shipped / "train.jsonl"), reward_fields=["answer"]),
        }
    )
    model = text_task.create_model(tmp_path / "model")
    size = text_task.VOCABULARY_SIZE
    run_trainer(1, model, tmp_path / "straight", steps=4, settings=settings, vocabulary=size)
    shared = tmp_path / "killed"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    hold = 2 * settings.rollout.prompts_per_step + 2  # the 10th request: position 9, step 3's second group
    held = settings.model_copy(update={"steps": 4})
    trainer = mp.get_context(RANKS).Process(
        target=_rank, args=(0, 1, port, str(model), str(shared), held, size, None, hold)
    )
    trainer.start()
    metrics = shared / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert trainer.is_alive() and time.monotonic() < deadline, "the trainer did not reach step 3"
        time.sleep(0.1)
    rank = psutil.Process(trainer.pid)
    killed = [rank, *rank.children(recursive=True)]  # its reward processes die with it, as a container's do
    for process in killed:
        process.kill()
    psutil.wait_procs(killed)
    trainer.join()
    assert sorted(recorded_rows(shared)) == [1, 2], "killed before learning step 3"
    resumed = run_trainer(1, model, shared, steps=4, settings=settings, vocabulary=size)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    learned, straight = recorded_rows(shared), recorded_rows(tmp_path / "straight")
    assert learned == straight, "the same rows, step by step"
    rows = [prompt for step in sorted(learned) for prompt in learned[step]]
    assert len(rows) == 4 * settings.rollout.prompts_per_step * settings.rollout.samples_per_prompt
    assert len(set(rows)) == 4 * settings.rollout.prompts_per_step, "no row learned twice, none skipped"


def test_a_resumed_trainer_takes_the_same_dataset_rows_and_evaluates_when_due(tmp_path: Path) -> None:
    """The demo's text task (spec.trainer.dataset, a reward on text, eval every 2 steps): a trainer stopped after
    step 2 and restarted asks for the same prompts in steps 3 and 4 as one that never stopped; each completion is
    recorded with its prompt's text, row and reward; eval_reward is reported before steps 1 and 3, and the resumed
    run's TensorBoard run (spec.trainer.tracking) holds steps 1 to 4. With spec.output every 2 steps, versions 2 and
    4 are written there, each the published version."""
    from lockstep_workers import text_task

    shipped = Path(__file__).resolve().parents[3] / "examples" / "datasets" / "larger"
    settings = SETTINGS.model_copy(
        update={
            "reward": "lockstep_workers.rewards:math_exact_match",
            "dataset": Dataset(
                train=str(shipped / "train.jsonl"), eval=str(shipped / "eval.jsonl"), reward_fields=["answer"]
            ),
            "eval": Evaluation(every_steps=2, prompts=5),
            "tracking": Tracking(tensorboard=True, mlflow=MlflowTracking()),
        }
    )
    model = text_task.create_model(tmp_path / "model")
    size = text_task.VOCABULARY_SIZE
    output = Output(path=str(tmp_path / "models"), every_steps=2, dtype=DType.FLOAT32)
    straight = run_trainer(1, model, tmp_path / "straight", 4, settings, size, output=output)
    run_trainer(1, model, tmp_path / "resumed", steps=2, settings=settings, vocabulary=size)
    resumed = run_trainer(1, model, tmp_path / "resumed", steps=4, settings=settings, vocabulary=size)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert [("eval_reward" in r) for r in straight] == [True, False, True, False]
    assert all(r["reward_errors"] == 0 for r in straight)

    def prompts(shared: Path) -> list[tuple[int, str, int]]:
        lines = [json.loads(line) for line in (shared / "rollouts.jsonl").read_text().splitlines()]
        assert all(line["prompt"].endswith(f"{line['row']['prompt']} assistant :") for line in lines)
        return [(line["step"], line["prompt"], line["row"]["answer"]) for line in lines]

    assert prompts(tmp_path / "resumed") == prompts(tmp_path / "straight")
    assert len({prompt for _, prompt, _ in prompts(tmp_path / "straight")}) == 4 * 4, "4 new rows a step"
    from safetensors.torch import load_file
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lockstep_workers.trainer.tracking import run_directory

    run = EventAccumulator(str(run_directory(tmp_path / "resumed")))
    run.Reload()
    assert [(e.step, e.value) for e in run.Scalars("reward")] == [
        (r["step"], pytest.approx(r["reward"])) for r in resumed
    ], "one TensorBoard run through the restart, as metrics.jsonl"
    assert [e.step for e in run.Scalars("eval_reward")] == [1, 3]
    from mlflow.tracking import MlflowClient

    mlflow = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'resumed' / 'mlflow.db'}")
    (tracked,) = mlflow.search_runs([e.experiment_id for e in mlflow.search_experiments()])
    assert tracked.info.status == "FINISHED", "one MLflow run through the restart, finished by the second trainer"
    history = mlflow.get_metric_history(tracked.info.run_id, "reward")
    assert [(m.step, m.value) for m in history] == [(r["step"], pytest.approx(r["reward"])) for r in resumed]
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["v000002", "v000004"]
    assert_same_weights(
        load_file(str(tmp_path / "models" / "v000004" / "model.safetensors")), published(tmp_path / "straight", 4)
    )


FIRST_STEP_GRADIENTS = Path(__file__).parent / "data" / "first_step_gradients.json"
"""Recorded from the serial loop (sample, then learn, then publish; commit c7a623c) by the test below's run."""


def test_max_lag_0_learns_the_first_step_with_the_gradients_of_the_serial_loop(tmp_path: Path) -> None:
    """maxLag 0 is synchronous on-policy RL as before the pipeline: the same seed gives the same gradients in the
    first step's first optimizer step as the serial loop gave (its fingerprint, recorded by this run on that code,
    whose default objective had no importance-sampling correction and no gradient clipping, so both off here)."""
    correction = SETTINGS.objective.rollout_correction.model_copy(update={"enabled": False})
    objective = SETTINGS.objective.model_copy(update={"rollout_correction": correction, "optimizer": UNCLIPPED})
    settings = SETTINGS.model_copy(update={"max_lag": 0, "seed": 3, "objective": objective})
    found = tmp_path / "gradients.json"
    run_trainer(1, create_tiny_llama(tmp_path / "model"), tmp_path / "shared", 1, settings, gradients=found)
    expected = json.loads(FIRST_STEP_GRADIENTS.read_text())
    torch.testing.assert_close(
        torch.tensor(json.loads(found.read_text())), torch.tensor(expected), rtol=1e-5, atol=1e-6
    )  # atol: a gradient's sum near 0 moves by rounding (the objective now sums in float64)


LORA = SETTINGS.model_copy(
    update={
        "lora": LoraSettings(rank=4, alpha=8),
        "objective": SETTINGS.objective.model_copy(update={"kl_coefficient": 0.05}),
    }
)
"""A LoRA job: an adapter of rank 4 on every linear module of the decoder layers, with a KL term to the base."""


def test_a_lora_job_publishes_its_adapter_alone_and_resumes_on_another_number_of_ranks(tmp_path: Path) -> None:
    """spec.trainer.lora: each version is the adapter alone, under PEFT's file names with its config in the header;
    2 ranks train as 1 does; stopped after step 2 and resumed on 1 rank from the checkpoint (the adapter and its
    optimizer state alone), it goes on as if never stopped; resumed from the published version 2 alone (no
    checkpoints), step 3 starts from that adapter (the entropy, measured before the step's first optimizer step, is
    that of the adapter that never stopped). Resuming with another adapter shape is refused."""
    import shutil

    from safetensors import safe_open

    from lockstep_workers.trainer.checkpoint import checkpoints_directory
    from lockstep_workers.trainer.model import check_adapter
    from lockstep_workers.weights import lora
    from lockstep_workers.weights.files import version_path, weights_directory

    model = create_tiny_llama(tmp_path / "model")
    straight = run_trainer(1, model, tmp_path / "straight", steps=4, settings=LORA)
    first = run_trainer(2, model, tmp_path / "resumed", steps=2, settings=LORA)
    # The same job's directory without its checkpoints: what a job that never checkpoints has published by step 2.
    shutil.copytree(tmp_path / "resumed", tmp_path / "published")
    shutil.rmtree(checkpoints_directory(tmp_path / "published"))
    resumed = run_trainer(1, model, tmp_path / "resumed", steps=4, settings=LORA)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for mine, theirs in zip(first + resumed[2:], straight, strict=True):
        for name in ("loss", "reward", "kl_new_old", "entropy", "grad_norm", "learning_rate", "kl_ref", "kl_loss"):
            assert mine[name] == pytest.approx(theirs[name], rel=1e-4, abs=1e-6), (mine["step"], name)
    assert all(r["kl_ref"] > 0 for r in straight), "each step's second minibatch learns after the adapter moved"

    modules = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}
    expected = {
        f"base_model.model.model.layers.{layer}.{part}.{module}.{weight}.weight"
        for layer in range(2)
        for part, names in modules.items()
        for module in names
        for weight in ("lora_A", "lora_B")
    }
    adapter = published(tmp_path / "straight", 4)
    assert set(adapter) == expected, "the adapter alone, under PEFT's file names"
    assert_trained_alike(published(tmp_path / "resumed", 4), adapter, tmp_path / "straight")
    assert all(not torch.equal(t, published(tmp_path / "straight", 1)[n]) for n, t in adapter.items()), "it learns"
    path = version_path(weights_directory(tmp_path / "straight"), 4)
    with safe_open(str(path), framework="pt") as opened:
        assert opened.metadata()["format"] == "pt"
    config = lora.adapter_config_of(path)
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (
        4,
        8,
        sorted(modules["self_attn"] + modules["mlp"]),
    )

    saved, found = checkpointed(tmp_path / "straight", 4), checkpointed(tmp_path / "resumed", 4)
    adapter_names = {lora.live_name(name) for name in expected}
    assert set(saved["model"]) == adapter_names, "a LoRA checkpoint holds the adapter, not the base"
    moments = saved["optimizer"]["state"]
    assert set(moments) == adapter_names == set(found["optimizer"]["state"])
    for name, state in moments.items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(found["optimizer"]["state"][name][key], state[key], rtol=1e-4, atol=1e-7)

    unchecked = LORA.model_copy(update={"checkpoint_every_steps": 0})
    from_version = run_trainer(1, model, tmp_path / "published", steps=3, settings=unchecked)
    assert not (tmp_path / "published" / "checkpoints").exists() or not any(
        (tmp_path / "published" / "checkpoints").iterdir()
    ), "checkpointEverySteps 0 writes none"
    assert from_version[2]["step"] == 3
    assert from_version[2]["entropy"] == pytest.approx(straight[2]["entropy"], rel=1e-5), "the adapter of version 2"
    assert from_version[2]["entropy"] != pytest.approx(straight[0]["entropy"], rel=1e-5), "not the base's"

    wider = lora.adapter_config(LoraSettings(rank=8, alpha=8), tiny(tmp_path / "model"))
    with pytest.raises(SystemExit, match=r"spec\.trainer\.lora changed since v000004\.safetensors was published \(r 4"):
        check_adapter(path, wider)


def test_a_lora_jobs_kl_reference_is_its_base_with_the_adapter_disabled(tmp_path: Path) -> None:
    """spec.trainer.objective.klCoefficient in a LoRA job: the reference logprobs are the base model's (the adapter
    disabled for that pass alone, no second copy); the adapter starts at zero, so the first step's KL is 0 and the
    next one's is not. A model without an adapter has none to disable: its KL needs a frozen reference."""
    base = tiny(tmp_path / "model")
    model = tiny(tmp_path / "model")
    lora.inject(model, lora.adapter_config(LoraSettings(rank=4, alpha=8, train_lm_head=True), model))
    rollouts = sample(base, [[1, 10, 11], [1, 20, 21]], group=4, length=5)
    rewards = [target_words(r.prompt, r.completion) for r in rollouts]
    objective = Objective(algorithm="grpo", minibatches=1, kl_coefficient=0.1, kl_estimator="k3")
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    first = learn(Policy(model), optimizer, rollouts, rewards, objective, TEMPERATURE, max_tokens=5)
    second = learn(Policy(model), optimizer, rollouts, rewards, objective, TEMPERATURE, max_tokens=5)
    assert first["kl_ref"] == 0 and first["kl_loss"] == 0
    assert second["kl_ref"] > 0 and second["kl_loss"] == pytest.approx(0.1 * second["kl_ref"], rel=0.5)
    expected, _, _ = token_logprobs(Policy(base), rollouts, TEMPERATURE)
    with torch.no_grad(), lora.base_only(model):
        reference, _, _ = token_logprobs(Policy(model), rollouts, TEMPERATURE)
    torch.testing.assert_close(reference, expected)
    with torch.no_grad():
        adapted, _, _ = token_logprobs(Policy(model), rollouts, TEMPERATURE)
    assert not torch.allclose(adapted, expected), "the adapter computes again after the reference's pass"
    with pytest.raises(ValueError, match="no LoRA adapter to disable"):
        learn(Policy(base), optimizer, rollouts, rewards, objective, TEMPERATURE, max_tokens=5)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_plus_plus"])
def test_each_advantage_estimator_learns_the_tiny_task(tmp_path: Path, estimator: str) -> None:
    """spec.trainer.objective.advantage: 12 steps of the tiny task (4 prompts x 6 completions of 6 tokens) raise the
    reward under each estimator."""
    torch.manual_seed(0)
    model = tiny(tmp_path / "model")
    objective = Objective(algorithm="grpo", advantage=estimator, learning_rate=3e-3, minibatches=1)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    prompts = [[1, 10, 11], [1, 20, 21], [1, 30, 31], [1, 40, 41]]
    history = []
    for _ in range(12):
        rollouts = sample(model, prompts, group=6, length=6)
        rewards = [target_words(r.prompt, r.completion) for r in rollouts]
        history.append(learn(Policy(model), optimizer, rollouts, rewards, objective, TEMPERATURE)["reward"])
    first, last = sum(history[:3]) / 3, sum(history[-3:]) / 3
    print(f"{estimator}: {' '.join(f'{r:.2f}' for r in history)}")
    assert last > first + 0.15, f"reward {first:.3f} -> {last:.3f}"
