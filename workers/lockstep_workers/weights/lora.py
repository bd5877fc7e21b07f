"""LoRA jobs (spec.trainer.lora): the adapter's PEFT config, found from the model; the names of its tensors in the
trainer's model and in PEFT's files; and the config that a published version carries.

A LoRA version is one safetensors file (lockstep_workers.weights) of the adapter's tensors alone, under PEFT's file
names, exactly as ``PeftModel.save_pretrained`` writes adapter_model.safetensors
(``base_model.model.<module path>.lora_A.weight``, ``...lora_B.weight``); its header's ``__metadata__`` holds
``"format": "pt"`` and, under ADAPTER_CONFIG_METADATA, the JSON of the trainer's ``peft.LoraConfig`` (target modules
an explicit sorted list), so that a reader writes adapter_config.json from it and loads exactly what the trainer
trained, with nothing outside the digest. Version 0 is the base model with no adapter (PEFT initialises lora_B to
zero: the same function).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lockstep.api import LoraSettings

if TYPE_CHECKING:
    from peft import LoraConfig

ADAPTER_CONFIG_METADATA = "adapter_config"
"""The header metadata key of a LoRA version's adapter config (JSON)."""
ADAPTER_NAME = "default"
"""PEFT's name of the one adapter: in the trainer's parameter names, never in the files."""
FILE_PREFIX = "base_model.model."
"""What PEFT's file names put before the module path in the causal LM."""
LORA_WEIGHTS = ("lora_A", "lora_B")
LM_HEAD = "lm_head"


class LoraSettingsError(ValueError):
    """spec.trainer.lora does not fit the model; the message names the field and what the model has."""


def linear_modules(causal_lm: Any) -> list[str]:
    """The names (the last part of each module path, as PEFT's target_modules match them) of the linear modules
    inside the decoder layers (``causal_lm.model.layers``), sorted: per architecture, from the model itself."""
    names = {
        path.rpartition(".")[2]
        for layer in causal_lm.model.layers
        for path, module in layer.named_modules()
        if isinstance(module, torch.nn.Linear)
    }
    return sorted(names)


def target_modules(settings: LoraSettings, causal_lm: Any) -> list[str]:
    """The modules that get an adapter, sorted: settings.target_modules (each one of ``linear_modules``), or by default
    every one of ``linear_modules``; the lm_head only with settings.train_lm_head. Raises LoraSettingsError."""
    known = linear_modules(causal_lm)
    wanted = set(settings.target_modules) if settings.target_modules is not None else set(known)
    if LM_HEAD in wanted and not settings.train_lm_head:
        raise LoraSettingsError(
            "spec.trainer.lora.targetModules: lm_head gets an adapter only with spec.trainer.lora.trainLmHead: true"
        )
    wanted.discard(LM_HEAD)
    unknown = sorted(wanted - set(known))
    if unknown:
        raise LoraSettingsError(
            f"spec.trainer.lora.targetModules: the model has no module named {unknown[0]!r}; its linear modules are: "
            f"{', '.join(known)}"
        )
    if settings.train_lm_head:
        if not isinstance(getattr(causal_lm, LM_HEAD, None), torch.nn.Linear):
            raise LoraSettingsError(
                f"spec.trainer.lora.trainLmHead: the model's lm_head is not a linear module "
                f"({type(getattr(causal_lm, LM_HEAD, None)).__name__})"
            )
        wanted.add(LM_HEAD)
    return sorted(wanted)


def adapter_config(settings: LoraSettings, causal_lm: Any) -> LoraConfig:
    """The PEFT config of the adapter spec.trainer.lora describes on ``causal_lm``: r = rank, lora_alpha = alpha,
    lora_dropout = dropout, no bias, a causal LM, target modules resolved by ``target_modules`` to an explicit
    sorted list. Raises LoraSettingsError when a name does not fit the model."""
    from peft import LoraConfig, TaskType

    alpha = settings.alpha
    return LoraConfig(
        r=settings.rank,
        lora_alpha=int(alpha) if float(alpha).is_integer() else alpha,  # type: ignore[arg-type]
        lora_dropout=settings.dropout,
        bias="none",
        task_type=TaskType.CAUSAL_LM,
        target_modules=target_modules(settings, causal_lm),
    )


def config_json(config: LoraConfig) -> str:
    """``config`` as the JSON of its ``to_dict()`` (sets, such as target_modules, as sorted lists; keys sorted)."""
    fields = {name: sorted(value) if isinstance(value, set) else value for name, value in config.to_dict().items()}
    return json.dumps(fields, sort_keys=True)


def adapter_metadata(config: LoraConfig) -> dict[str, str]:
    """The safetensors header metadata of a LoRA version trained with ``config``."""
    return {"format": "pt", ADAPTER_CONFIG_METADATA: config_json(config)}


def file_name(live: str) -> str:
    """A LoRA parameter's name in the trainer's causal LM, once PEFT injected the adapter
    (``<module path>.lora_A.default.weight``), to its name in PEFT's files
    (``base_model.model.<module path>.lora_A.weight``). Raises ValueError for any other name."""
    parts = live.split(".")
    if len(parts) < 4 or parts[-3] not in LORA_WEIGHTS or parts[-2] != ADAPTER_NAME:
        raise ValueError(f"{live!r} is not a LoRA adapter's parameter (<module>.lora_A|lora_B.{ADAPTER_NAME}.<name>)")
    return FILE_PREFIX + ".".join([*parts[:-2], parts[-1]])


def live_name(stored: str) -> str:
    """The inverse of ``file_name``: a name in PEFT's files to the trainer's parameter name. Raises ValueError for a
    name that is not an adapter tensor's."""
    parts = stored.removeprefix(FILE_PREFIX).split(".")
    if not stored.startswith(FILE_PREFIX) or len(parts) < 3 or parts[-2] not in LORA_WEIGHTS:
        raise ValueError(f"{stored!r} is not a LoRA adapter tensor's file name ({FILE_PREFIX}<module>.lora_A|lora_B.*)")
    return ".".join([*parts[:-1], ADAPTER_NAME, parts[-1]])


def file_names(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter's tensors, under the trainer's names, renamed to PEFT's file names."""
    return {file_name(name): tensor for name, tensor in tensors.items()}


def live_names(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A published adapter's tensors, under PEFT's file names, renamed to the trainer's names."""
    return {live_name(name): tensor for name, tensor in tensors.items()}


def adapter_config_of(path: Path | str) -> dict[str, Any]:
    """The adapter config (PEFT's adapter_config.json, as a dict) of the published LoRA version at ``path``, from its
    safetensors header. Raises ValueError when the file carries none (full weights, not an adapter)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as opened:
        metadata = opened.metadata() or {}
    if ADAPTER_CONFIG_METADATA not in metadata:
        raise ValueError(f"{path} is not a LoRA adapter version: its header has no {ADAPTER_CONFIG_METADATA!r}")
    config: dict[str, Any] = json.loads(metadata[ADAPTER_CONFIG_METADATA])
    return config


def inject(causal_lm: torch.nn.Module, config: LoraConfig) -> None:
    """Inject the adapter of ``config`` into ``causal_lm`` in place (PEFT's get_peft_model replaces each target
    Linear with a LoRA layer around it), so that ``causal_lm`` itself is the model to shard and to learn with: every
    base parameter frozen, only the adapter's trainable; lora_B starts at zero, so the model computes what the base
    does. With a dropout, the model is put in train mode, where the dropout acts."""
    from peft import get_peft_model

    wrapped: Any = get_peft_model(causal_lm, config)
    if wrapped.base_model.model is not causal_lm:
        raise RuntimeError("PEFT wrapped a copy of the model instead of injecting its adapter in place")
    if config.lora_dropout:
        causal_lm.train()


@contextlib.contextmanager
def base_only(causal_lm: torch.nn.Module) -> Iterator[None]:
    """Within: ``causal_lm`` computes as its base model, every LoRA layer's adapter disabled (what PeftModel's
    disable_adapter does, on the model the adapter was injected into); the reference policy of a LoRA job's KL term.
    Raises ValueError on a model without an adapter."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [module for module in causal_lm.modules() if isinstance(module, BaseTunerLayer)]
    if not layers:
        raise ValueError(
            "the model has no LoRA adapter to disable: without one, the KL term's reference is a frozen copy of the "
            "model (learn's reference)"
        )
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)
