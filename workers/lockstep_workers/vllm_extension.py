"""A vLLM worker extension (``worker_extension_cls``): how the actor loads new weights in place, and checks them.

On this vLLM's CPU backend the linear weights are repacked after loading, so a plain
``model.load_weights`` fails; ``model_runner.reload_weights`` with checkpoint-format tensors works. It does not
re-derive what vLLM derives from a weight that the checkpoint does not name: a head tied to the embeddings is not
in a Hugging Face checkpoint, so its repacked copy kept the old head after every update (measured on
SmolLM2-135M-Instruct: 2.04 nats). So after each reload the tied modules are tied again and re-processed, and then
every module is checked against the published tensors (lockstep_workers.load_check) before the actor may resume.
Reached only through AsyncLLM.collective_rpc inside the actor process, never over HTTP.

Importing it (vLLM does, in every worker process, before the model loads) also registers the gloo
weight-transfer engine with vLLM's factory (lockstep_workers.gloo_engine).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from lockstep_workers.load_check import LoadReport, check_loaded, retie, tied_groups
from lockstep_workers.transfer import GLOO_ENGINE
from lockstep_workers.weights import tensors

with contextlib.suppress(ValueError):  # "already registered": this module was imported before
    WeightTransferEngineFactory.register_engine(GLOO_ENGINE, "lockstep_workers.gloo_engine", "GlooWeightTransferEngine")


class WeightReloader:
    model_runner: Any
    _lockstep_tied: list[list[str]] | None = None

    def lockstep_reload(self, path: str) -> dict[str, Any]:
        """Load the weights at ``path`` (the actor's verified copy, ``/proc/<actor pid>/fd/<n>``, never the file
        the URI names), re-derive tied modules, and check every module against the file; return the check's
        report. Raises LoadMismatch, naming the module, when the engine does not compute with the file's tensors."""
        model = self.model_runner.get_model()
        if self._lockstep_tied is None:  # the ties vLLM made at start, before any reload could break them
            self._lockstep_tied = tied_groups(model)
        self.model_runner.reload_weights(weights_iterator=tensors(Path(path)), is_checkpoint_format=True)
        retie(model, self._lockstep_tied)
        report: LoadReport = check_loaded(model, Path(path), self._lockstep_tied)
        return report.as_dict()
