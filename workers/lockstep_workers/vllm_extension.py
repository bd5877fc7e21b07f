"""A vLLM worker extension (``worker_extension_cls``): how the actor loads new weights in place.

On this vLLM's CPU backend the linear weights are repacked after loading, so a plain
``model.load_weights`` fails; ``model_runner.reload_weights`` with checkpoint-format tensors works.
Reached only through AsyncLLM.collective_rpc inside the actor process, never over HTTP.

Importing it (vLLM does, in every worker process, before the model loads) also registers the gloo
weight-transfer engine with vLLM's factory (lockstep_workers.gloo_engine).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from lockstep_workers.transfer import GLOO_ENGINE
from lockstep_workers.weights import tensors

with contextlib.suppress(ValueError):  # "already registered": this module was imported before
    WeightTransferEngineFactory.register_engine(GLOO_ENGINE, "lockstep_workers.gloo_engine", "GlooWeightTransferEngine")


class WeightReloader:
    model_runner: Any

    def lockstep_reload(self, path: str) -> None:
        """Load the weights at ``path``: the actor's verified copy (``/proc/<actor pid>/fd/<n>``), never the file
        the URI names."""
        self.model_runner.reload_weights(weights_iterator=tensors(Path(path)), is_checkpoint_format=True)
