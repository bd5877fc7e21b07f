"""A vLLM worker extension (``worker_extension_cls``): how the actor loads new weights in place, and checks them.

On this vLLM's CPU backend the linear weights are repacked after loading, so a plain
``model.load_weights`` fails; ``model_runner.reload_weights`` with checkpoint-format tensors works. It does not
re-derive what vLLM derives from a weight that the checkpoint does not name: a head tied to the embeddings is not
in a Hugging Face checkpoint, so its repacked copy kept the old head after every update (measured on
SmolLM2-135M-Instruct: 2.04 nats). So after each reload the tied modules are tied again and re-processed, and then
every module is checked against the published tensors (lockstep_workers.actor.load_check) before the actor may resume.
Before each reload (a file's or a transfer group's), the mixture-of-experts layers are made to redo the processing
vLLM's CPU backend skips on a reload (prepare_moe_reload).
Reached only through AsyncLLM.collective_rpc inside the actor process, never over HTTP.

Importing it (vLLM does, in every worker process, before the model loads) also registers the gloo
weight-transfer engine with vLLM's factory (lockstep_workers.weights.gloo_engine).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

from lockstep_workers.actor.load_check import LoadReport, check_loaded, retie, tied_groups
from lockstep_workers.weights.files import tensors
from lockstep_workers.weights.transfer import GLOO_ENGINE

with contextlib.suppress(ValueError):  # "already registered": this module was imported before
    WeightTransferEngineFactory.register_engine(
        GLOO_ENGINE, "lockstep_workers.weights.gloo_engine", "GlooWeightTransferEngine"
    )


def prepare_moe_reload(model: torch.nn.Module) -> None:
    """Make each mixture-of-experts layer of vLLM's CPU backend redo, on the next reload, the processing vLLM does at
    its first load. Call it before every reload: a file's (reload_weights) and a transfer group's
    (start_weight_update).

    vLLM's unquantized experts (UnquantizedFusedMoEMethod._setup_kernel) treat a reload as a weight update once the
    layer has its kernel (``moe_kernel``): they convert the new weights and copy them in, but skip the kernel's own
    ``process_weights_after_loading``. On the CPU backend that hook is where the experts are prepacked
    (cpu_prepack_moe_weight), so a reload left them in the checkpoint's layout where the kernel reads the packed one:
    neither version computed (issue 44: up to 0.47 nats on a tiny Mixtral). Clearing ``moe_kernel`` makes the reload
    take vLLM's first-load path: convert, build the kernel, run the hook; vLLM's layer-wise reload then copies the
    result into the parameters' original storage.

    Harmless on CUDA: only the CPU backend's layers are touched. On the others the hook is absent (Triton, AITER) or
    acts only on quantized scales (FlashInfer CUTLASS), and the conversion a reload needs runs on every reload, so
    their reload stays exactly vLLM's: the kernel they built, with any CUDA graph captured around it, is kept.
    Quantized methods have reload paths of their own and are left alone too."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, UnquantizedFusedMoEMethod) and method.unquantized_backend is UnquantizedMoeBackend.CPU:
            method.moe_kernel = None


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
        prepare_moe_reload(model)
        self.model_runner.reload_weights(weights_iterator=tensors(Path(path)), is_checkpoint_format=True)
        retie(model, tied)
        report: LoadReport = check_loaded(model, Path(path), tied)
        return report.as_dict()

    def lockstep_prepare_update(self) -> list[list[str]]:
        """Just before a transfer group's update (gloo, NCCL): record the ties (if not yet) and make the experts redo
        their processing (prepare_moe_reload); return the ties."""
        model = self.model_runner.get_model()
        tied = self._tied(model)
        prepare_moe_reload(model)
        return tied

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
