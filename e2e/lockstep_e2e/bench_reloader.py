"""The benchmark's vLLM worker extension (``worker_extension_cls``): the actor's own (WeightReloader), plus a
measurement of vLLM's reload from tensors already in memory. Only bench_weights runs it; reached only through
AsyncLLM.collective_rpc, never over HTTP."""

from __future__ import annotations

import time
from pathlib import Path

from lockstep_workers.vllm_extension import WeightReloader
from lockstep_workers.weights import tensors


class TimedReloader(WeightReloader):
    def lockstep_timed_reload(self, path: str) -> dict[str, float]:
        """Reload the weights at ``path`` as ``lockstep_reload`` does, in two timed parts: copying them into
        tensors of this worker's own (``read``), then vLLM's reload from those tensors (``reload``)."""
        started = time.monotonic()
        held = [(name, tensor.clone()) for name, tensor in tensors(Path(path))]
        read = time.monotonic()
        self.model_runner.reload_weights(weights_iterator=iter(held), is_checkpoint_format=True)
        return {"read": read - started, "reload": time.monotonic() - read}
