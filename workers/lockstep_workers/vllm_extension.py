"""A vLLM worker extension (``worker_extension_cls``): how the actor loads new weights in place.

On this vLLM's CPU backend the linear weights are repacked after loading, so a plain
``model.load_weights`` fails; ``model_runner.reload_weights`` with checkpoint-format tensors works.
Reached only through AsyncLLM.collective_rpc inside the actor process, never over HTTP.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lockstep_workers.weights import tensors


class WeightReloader:
    model_runner: Any

    def lockstep_reload(self, path: str) -> None:
        self.model_runner.reload_weights(weights_iterator=tensors(Path(path)), is_checkpoint_format=True)
