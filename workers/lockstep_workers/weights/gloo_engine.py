"""The gloo weight-transfer engine for vLLM's workers (spec.weightSync.backend: gloo): vLLM's NCCL engine
lifecycle (start, receive and load layer by layer, finish) over a gloo process group, one tensor at a time.
Registered with vLLM's WeightTransferEngineFactory by lockstep_workers.actor.vllm_extension."""

from __future__ import annotations

from typing import Any

import torch
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

from lockstep_workers.weights.transfer import gloo_group


class GlooWeightTransferEngine(NCCLWeightTransferEngine):
    gloo: Any = None
    """The gloo process group of the current barrier."""

    def init_transfer_engine(self, init_info: Any) -> None:
        """Join the trainer's group at this worker's rank: vLLM's numbering, after ``rank_offset``."""
        parallel = self.parallel_config
        rank = parallel.data_parallel_index * parallel.world_size + parallel.rank + init_info.rank_offset
        self.gloo = gloo_group(init_info.master_address, init_info.master_port, rank, init_info.world_size)

    def receive_weights(self, update_info: Any) -> None:
        """Receive each tensor the manifest names from rank 0 and load it."""
        for name, dtype_name, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes, strict=True):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype_name))
            self.gloo.broadcast(tensor, 0).wait()
            self.model.load_weights([(name, tensor)])  # type: ignore[operator]  # vLLM models have it

    def shutdown(self) -> None:
        self.gloo = None
