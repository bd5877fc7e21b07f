"""e2e/gpu/bench.py, which e2e/gpu/check.sh runs on a lent GPU, runs here on the CPU with the same code path (the
sharded trainer's step, activation checkpointing, a KL reference in host memory, the logprob gap, the profile), so
that a change to the trainer that breaks it is seen before device time is spent on it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_gpu_benchmark_runs_a_bf16_step_with_checkpointing_and_an_offloaded_kl_reference_and_its_profile(
    tmp_path: Path,
) -> None:
    out = tmp_path / "bench.jsonl"
    command = [sys.executable, "e2e/gpu/bench.py", "--model", "tiny", "--steps", "2", "--warmup", "1"]
    command += ["--dtype", "bfloat16", "--ac", "--kl-reference", "host", "--gap", "--profile", "--out", str(out)]
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(["operator", "workers"])}
    done = subprocess.run(command, cwd=REPO, env=environment, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["collectives"] == [["gloo", "cpu"]] and result["tokens_per_second"] > 0
    assert 0 < result["mean_abs_logprob_gap"] < 0.1, "bf16 layers against the fp32 reference: a gap, and a small one"
    assert "Self CPU time total" in done.stdout and "aten::mm" in done.stdout, "the profile's table"
