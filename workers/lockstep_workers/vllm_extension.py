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

    def _tied(self, model: Any) -> list[list[str]]:
        """The ties vLLM made at start, recorded at the first call, before any reload could break them."""
        if self._lockstep_tied is None:
            self._lockstep_tied = tied_groups(model)
        return self._lockstep_tied

    def lockstep_reload(self, path: str) -> dict[str, Any]:
        """Load the weights at ``path`` (the actor's verified copy, ``/proc/<actor pid>/fd/<n>``, never the file
        the URI names), re-derive tied modules, and check every module against the file; return the check's
        report. Raises LoadMismatch, naming the module, when the engine does not compute with the file's tensors."""
        model = self.model_runner.get_model()
        tied = self._tied(model)
        self.model_runner.reload_weights(weights_iterator=tensors(Path(path)), is_checkpoint_format=True)
        retie(model, tied)
        report: LoadReport = check_loaded(model, Path(path), tied)
        return report.as_dict()

    def lockstep_ties(self) -> list[list[str]]:
        """Record the ties (if not yet), before a transfer group's update; return them."""
        return self._tied(self.model_runner.get_model())

    def lockstep_retie(self) -> None:
        """Re-derive the tied modules after a transfer group's update (gloo, NCCL): vLLM's update_weights loads
        the embeddings but leaves a tied head's repacked copy as it was (measured: lockstep_e2e.models_matrix)."""
        model = self.model_runner.get_model()
        retie(model, self._tied(model))

    def lockstep_check(self, path: str) -> dict[str, Any]:
        """Check, without loading anything, that every module computes with the tensors of the safetensors file at
        ``path`` (after an update by any transport); return the check's report or raise LoadMismatch. Used by
        lockstep_e2e.models_matrix after a transfer group's update, whose actor has no file to check against."""
        model = self.model_runner.get_model()
        return check_loaded(model, Path(path), self._tied(model)).as_dict()
