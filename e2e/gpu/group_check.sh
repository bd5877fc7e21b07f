#!/usr/bin/env bash
# Issue 36's actor group on GPUs: one vLLM engine split over two processes standing for two pods of a group, one GPU
# each, and the load check of two tensor-parallel workers on their shards. Never run yet: it needs vLLM's CUDA build
# and at least two GPUs, and the device machines lent so far have one GPU and no vLLM (docs/actor-groups.md).
#
# From the repository root of a machine with lockstep[workers,dev] and vLLM installed: e2e/gpu/group_check.sh
# It runs the same two tests as on the CPU (workers/tests/test_actor.py's group of two pods: the actor's engine as the
# leader, lockstep_workers.headless as the worker, tensor parallel 2, an in-flight update loaded on both ranks and
# logprobs against transformers' across it; and
# workers/tests/test_tensor_parallel_load.py's reload checked on both shards), with vLLM on CUDA.
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
python3 -m pytest -q -p no:cacheprovider --timeout 600 workers/tests/test_tensor_parallel_load.py \
  "workers/tests/test_actor.py::test_an_in_flight_update_reaches_every_rank_of_a_group_split_over_two_pods"
