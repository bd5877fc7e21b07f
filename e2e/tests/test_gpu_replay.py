"""e2e/gpu/replay.py, which e2e/gpu/replay_check.sh runs where a lent device has vLLM's CUDA build (none has yet),
checked here without an engine: the layer axis of vLLM's routed experts told from the model's layers, the trainer's
half of the report on routings given as vLLM returns them (all layers, a dense layer's rows 0), and the clear refusal
on this machine's CPU build."""

from __future__ import annotations

import importlib.util
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lockstep_workers.rollout.record import Rollout
from lockstep_workers.trainer import routing
from lockstep_workers.trainer.learner import Policy, token_logprobs

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("replay", REPO / "e2e" / "gpu" / "replay.py")
assert _spec is not None and _spec.loader is not None
replay: Any = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(replay)


def test_the_layer_axis_of_the_engines_routed_experts_is_told_from_the_models_layers() -> None:
    experts = torch.arange(5 * 2 * 2).reshape(5, 2, 2)  # 5 rows: a prompt of 3 and a completion of 3, less one
    sample = ([1, 2, 3], [4, 5, 6], experts)
    assert replay.shapes([sample], 2, [1]) == {
        "routed_experts_per_token": [2, 2],
        "rows_minus_tokens": [-1],
        "model_layers": 2,
        "moe_layers": [1],
        "layer_axis": replay.ALL_LAYERS,
    }
    only_moe = experts[:, 1:]
    assert replay.shapes([(sample[0], sample[1], only_moe)], 2, [1])["layer_axis"] == replay.MOE_LAYERS
    assert replay.shapes([sample], 2, [0, 1])["layer_axis"] == replay.EVERY_LAYER_MOE
    with pytest.raises(ValueError, match="3 layers; the model has 2 layers, 1 of them MoE layers"):
        replay.layer_axis(3, 2, [1])
    with pytest.raises(ValueError, match="differ in shape per token"):
        replay.shapes([sample, (sample[0], sample[1], only_moe)], 2, [1])


def test_the_report_tells_replayed_routings_from_the_trainers_own(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    causal_lm = AutoModelForCausalLM.from_pretrained(replay.tiny_moe(tmp_path, 0, "float32"), dtype=torch.float32)
    policy = Policy(causal_lm.eval(), fp32_head=True)
    assert routing.moe_layers(causal_lm) == [1], "layer 0 is the dense one"
    words = random.Random(0)
    rollouts = [
        Rollout([words.randrange(3, 256) for _ in range(8)], [words.randrange(3, 256) for _ in range(6)], [], 0)
    ]
    rollouts += [
        Rollout([words.randrange(3, 256) for _ in range(5)], [words.randrange(3, 256) for _ in range(4)], [], 1)
    ]
    moe = routing.routers(causal_lm)
    with torch.no_grad(), routing.routed(moe) as record:
        own_logprobs, _, _ = token_logprobs(policy, rollouts, 1.0)
    longest = max(len(r.prompt) + len(r.completion) for r in rollouts)
    own = record.own[0].reshape(len(rollouts), longest, 1, -1)

    def as_engine(routings: torch.Tensor, logprobs: torch.Tensor) -> list[Rollout]:
        """The rollouts with ``logprobs`` and ``routings`` ([sequences, longest, MoE layers, top_k]) as vLLM returns
        them (every layer, the dense layer's rows 0, none for the last token) and the script maps them."""
        engine = []
        for row, r in enumerate(rollouts):
            rows = routings[row, : len(r.prompt) + len(r.completion) - 1]
            vllm_rows = torch.cat([torch.zeros_like(rows), rows], dim=1)
            engine.append((r.prompt, r.completion, vllm_rows))
        seen = replay.shapes(engine, 2, [1])
        assert seen["layer_axis"] == replay.ALL_LAYERS and seen["rows_minus_tokens"] == [-1]
        return [
            Rollout(
                p,
                c,
                logprobs[row, : len(c)].tolist(),
                row,
                routed_experts=routing.over_moe_layers(e, causal_lm),
            )
            for row, (p, c, e) in enumerate(engine)
        ]

    same = replay.measure(policy, as_engine(own, own_logprobs), 1.0)
    assert same["tokens"] == 10 and same["routing_mismatch"] == 0.0 == same["routing_mismatch_replaying"]
    assert same["max_abs_logprob_gap_without_replay"] < 1e-5 and same["max_abs_logprob_gap_with_replay"] < 1e-5

    experts = torch.arange(4)  # 4 experts, top-2: every token's other two
    other = experts.expand(*own.shape[:-1], 4)[(own[..., None] != experts).all(dim=-2)].reshape(own.shape)
    forced = as_engine(other, torch.zeros_like(own_logprobs))
    forced_logprobs, _, _ = replay.trainer_pass(policy, forced, 1.0, replay=True)
    differs = replay.measure(policy, as_engine(other, forced_logprobs), 1.0)
    assert differs["routing_mismatch"] == 1.0 == differs["routing_mismatch_replaying"]
    assert differs["max_abs_logprob_gap_with_replay"] < 1e-5, "replayed: the engine's experts, its logprobs"
    assert differs["mean_abs_logprob_gap_without_replay"] > 1e-3, "the trainer's own experts: other logprobs"


def test_the_check_refuses_in_one_line_where_vllm_is_not_the_cuda_build() -> None:
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(["operator", "workers"])}
    command = [sys.executable, "e2e/gpu/replay.py"]
    done = subprocess.run(command, cwd=REPO, env=environment, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("routing replay's engine check does not run: ") and "CUDA" in line, line
