#!/usr/bin/env bash
# The trainer on one CUDA GPU (issue 12), in under 5 minutes, on a machine with torch, transformers and safetensors
# installed. First, here: e2e/gpu/wheels.sh (the small dependencies as wheels, in out/gpu-wheels). Then, from the
# repository root there (with the device tool: carry ["out/gpu-wheels"]): e2e/gpu/check.sh
#
# It runs the trainer's own code (lockstep_workers.trainer.learner.learn on a model sharded by lockstep_workers.trainer.sharding:
# FSDP2 with 1 rank over NCCL, bf16 layers, fp32 master weights) on a random Llama of 0.44B parameters, a batch of
# 16 sequences of 256 prompt and 768 completion tokens, with the fp32 lm_head and then the bf16 one, and reports
# for each (one JSON line, also appended to $OUT/gpu-check.jsonl, or out/gpu/gpu-check.jsonl):
# tokens/s, peak GPU memory, MFU against the GPU's dense bf16 peak, the logprob gap to an fp32 reference of the
# same weights, and the backend and device of every all_reduce the step and its metrics ran (must be nccl, cuda).
set -euo pipefail
cd "$(dirname "$0")/../.."
results="${OUT:-out/gpu}"
mkdir -p "$results"
if compgen -G "out/gpu-wheels/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/lockstep-site \
    out/gpu-wheels/*.whl
  export PYTHONPATH=/tmp/lockstep-site
fi
export PYTHONPATH="operator:workers${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
shape=(--model llama-0.5b --prompts 4 --group 4 --prompt-tokens 256 --completion-tokens 768 --dtype bfloat16
  --steps 8 --warmup 3 --threads 0 --gap --out "$results/gpu-check.jsonl")
timeout 150 python3 e2e/gpu/bench.py "${shape[@]}" --head float32
timeout 120 python3 e2e/gpu/bench.py "${shape[@]}" --head bfloat16
python3 - "$results/gpu-check.jsonl" <<'PY'
import json, sys
runs = [json.loads(line) for line in open(sys.argv[1])]
print(f"{'head':>9} {'tokens/s':>9} {'MFU':>6} {'peak GiB':>8} {'mean |Δlogprob|':>16} {'max':>8}  collectives")
for run in runs:
    print(f"{run['head']:>9} {run['tokens_per_second']:>9} {run['mfu']:>6.1%} {run['peak_memory_gib']:>8} "
          f"{run['mean_abs_logprob_gap']:>16.2e} {run['max_abs_logprob_gap']:>8.2e}  {run['collectives']}")
wrong = [c for run in runs for c in run["collectives"] if c != ["nccl", "cuda:0"]]
assert not wrong, f"collectives off NCCL or off the GPU: {wrong}"
print("every all_reduce of the step and its metrics ran on NCCL with CUDA tensors")
PY
