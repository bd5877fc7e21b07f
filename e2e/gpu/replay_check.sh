#!/usr/bin/env bash
# Routing replay's engine half (issue 44) on one CUDA GPU: vLLM's routed experts for a tiny random Qwen3-MoE, served
# as the actor serves a replaying job, replayed in the trainer's code (e2e/gpu/replay.py says what it reports). Never
# run yet: it needs vLLM's CUDA build, and the device machines lent so far have had no vLLM (docs/parity.md); not
# part of e2e/gpu/check.sh. Its pure parts and the trainer's half run on the CPU in e2e/tests/test_gpu_replay.py.
#
# From the repository root of a machine with lockstep[workers,dev] and vLLM's CUDA build installed:
# e2e/gpu/replay_check.sh. Two JSON lines (also appended to $OUT/replay-check.jsonl, or out/gpu/replay-check.jsonl):
# the model with every layer an MoE layer, then with layer 0 dense (which tells whether vLLM's layer axis counts all
# layers or only the MoE ones). Engine in fp32; if vLLM's kernels refuse fp32, rerun replay.py with --dtype bfloat16.
set -euo pipefail
cd "$(dirname "$0")/../.."
results="${OUT:-out/gpu}"
mkdir -p "$results"
if ! nvidia-smi -L >/dev/null 2>&1; then
  echo "routing replay's engine check needs a CUDA GPU; nvidia-smi finds none" >&2
  exit 2
fi
if ! python3 -c "import vllm" 2>/dev/null; then
  echo "routing replay's engine check needs vLLM's CUDA build installed (pip install vllm with lockstep[workers,dev])" >&2
  exit 2
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
export PYTHONPATH="operator:workers${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 VLLM_TARGET_DEVICE=cuda HF_HUB_OFFLINE=1
timeout 300 python3 e2e/gpu/replay.py --out "$results/replay-check.jsonl"
timeout 300 python3 e2e/gpu/replay.py --dense-layer 0 --out "$results/replay-check.jsonl"
