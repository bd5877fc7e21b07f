#!/usr/bin/env bash
# Issue 36's actor group on GPUs: the reload of a tensor-parallel engine of two ranks, one GPU each, checked on both
# shards (workers/tests/actor/test_load_check.py, as on the CPU, with vLLM on CUDA). Never run yet: it needs vLLM's
# CUDA build and at least two GPUs, and the device machines lent so far have one GPU and no vLLM
# (docs/actor-groups.md). The engine split over two pods (the leader's actor and lockstep_workers.actor.headless) is tested
# on the CPU by e2e/tests/test_rl_job.py's job of a group, which needs the local control plane: not here.
#
# From the repository root of a machine with lockstep[workers,dev] and vLLM installed: e2e/gpu/group_check.sh

set -euo pipefail
cd "$(dirname "$0")/../.."
gpus=$(nvidia-smi -L | wc -l)
if [ "$gpus" -lt 2 ]; then
  echo "an actor group's check needs 2 GPUs (one per process, as one per pod); this machine has $gpus" >&2
  exit 2
fi
if ! python3 -c "import vllm" 2>/dev/null; then
  echo "an actor group's check needs vLLM's CUDA build installed (pip install vllm with lockstep[workers,dev])" >&2
  exit 2
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
export PYTHONPATH="operator:workers:e2e${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 VLLM_TARGET_DEVICE=cuda
python3 -m pytest -q -p no:cacheprovider --timeout 600 workers/tests/actor/test_load_check.py
