"""The benchmark's vLLM worker extension (``worker_extension_cls``): the actor's own (WeightReloader), plus a
measurement of vLLM's reload from tensors already in memory. Only bench_weights runs it; reached only through
AsyncLLM.collective_rpc, never over HTTP."""

from __future__ import annotations

import time
from pathlib import Path

from lockstep_workers.actor.load_check import check_loaded, retie, tied_groups
from lockstep_workers.actor.vllm_extension import WeightReloader
from lockstep_workers.weights.files import tensors


class TimedReloader(WeightReloader):
    def lockstep_timed_reload(self, path: str) -> dict[str, float]:
        """Reload the weights at ``path`` as ``lockstep_reload`` does, in three timed parts: copying them into
        tensors of this worker's own (``read``), vLLM's reload from those tensors (``reload``), then the re-tie and
        the load check (``check``, lockstep_workers.actor.load_check)."""
        model = self.model_runner.get_model()
        tied = tied_groups(model)
        started = time.monotonic()
        held = [(name, tensor.clone()) for name, tensor in tensors(Path(path))]
        read = time.monotonic()
        self.model_runner.reload_weights(weights_iterator=iter(held), is_checkpoint_format=True)
        reloaded = time.monotonic()
        retie(model, tied)
        check_loaded(model, Path(path), tied)
        return {"read": read - started, "reload": reloaded - read, "check": time.monotonic() - reloaded}
