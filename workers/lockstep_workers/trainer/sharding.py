"""The trainer's ranks and their shards: the accelerator a rank computes on, its process group, the model sharded
with FSDP2 over a DeviceMesh, and its full state dict gathered from the shards.

A rank with a GPU computes on ``cuda:$LOCAL_RANK`` and its collectives go over NCCL; without one, on the CPU over
gloo. The same code runs on either, and on one rank as on many.
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from lockstep_workers.trainer.learner import Policy


def accelerator(local_rank: int) -> torch.device:
    """Where a rank computes: its GPU (``cuda:<local_rank>``) when the pod has one, else the CPU."""
    return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")


def start(rank: int, world_size: int, device: torch.device) -> DeviceMesh:
    """Join the trainer's process group (NCCL for CUDA tensors, gloo for CPU tensors; $MASTER_ADDR and $MASTER_PORT
    on several ranks) and return its one-dimensional mesh."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.HashStore() if world_size == 1 else None  # type: ignore[attr-defined]
    device_id = device if device.type == "cuda" else None
    dist.init_process_group(backend, rank=rank, world_size=world_size, store=store, device_id=device_id)
    return init_device_mesh(device.type, (world_size,))


def shard(
    causal_lm: Any,
    mesh: DeviceMesh,
    *,
    compute_dtype: torch.dtype,
    fp32_head: bool,
    activation_checkpointing: bool = False,
    offload: bool = False,
) -> Policy:
    """``causal_lm`` (fp32 parameters: the master weights) sharded over ``mesh`` with FSDP2, as a Policy.

    Each decoder layer and the final norm compute in ``compute_dtype``; the embeddings and the lm_head, one unit
    (tied weights must be), in fp32 when ``fp32_head``, else in ``compute_dtype``. Gradients are reduced in fp32.
    ``activation_checkpointing`` recomputes each layer's activations in the backward pass (Hugging Face's
    gradient checkpointing: it acts in train mode, which Llama-family models, without dropout, compute alike).
    ``offload``: the parameters stay in host memory, each unit's copied to the accelerator for its forward (FSDP2's
    CPU offload; for a frozen model: its gradients would be reduced on the CPU too).
    """
    if activation_checkpointing:
        causal_lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        causal_lm.train()
    placement = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if offload else OffloadPolicy()
    body = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for layer in causal_lm.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=body, offload_policy=placement)
    fully_shard(causal_lm.model.norm, mesh=mesh, mp_policy=body, offload_policy=placement)
    head = MixedPrecisionPolicy(param_dtype=torch.float32 if fp32_head else compute_dtype, reduce_dtype=torch.float32)
    policy = Policy(causal_lm, fp32_head=fp32_head)
    fully_shard(policy, mesh=mesh, mp_policy=head, offload_policy=placement)
    return policy


TRAINABLE = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
"""Whole tensors, on rank 0 and in CPU memory, without the frozen parameters (a LoRA job's base)."""


def full_state_dict(causal_lm: torch.nn.Module, *, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """The whole model in its checkpoint's (Hugging Face) names, on rank 0 in CPU memory (empty on the other ranks;
    a collective): tied weights once, under the first name that uses them, as Hugging Face writes checkpoints.
    ``trainable_only``: only the parameters that train (a LoRA adapter: only its tensors are gathered, under the
    names the model holds them by). The tensors are a snapshot: no later optimizer step changes them (on one CPU
    rank the gathered tensors are the live parameters themselves, so those are copied)."""
    if not trainable_only:
        return {name: tensor for layer in gathered_layers(causal_lm) for name, tensor in layer.items()}
    live = _live_storages(causal_lm)
    gathered = get_model_state_dict(causal_lm, options=TRAINABLE)
    trains = {name for name, parameter in causal_lm.named_parameters() if parameter.requires_grad}
    return {name: _snapshot(t, live) for name, t in gathered.items() if name in trains and isinstance(t, torch.Tensor)}


def gathered_layers(causal_lm: torch.nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """The whole model in its checkpoint's names (``checkpoint_names``), one decoder layer at a time, in the order
    of ``checkpoint_layout``: on rank 0 each layer's tensors whole, in CPU memory, and a snapshot; on the other ranks
    empty dicts. A collective: every rank iterates it to the end, each tensor gathered from its shards in turn, so
    that no rank ever holds more of the model whole than the layer it yields."""
    keeps = not dist.is_initialized() or dist.get_rank() == 0
    live = _live_storages(causal_lm)
    state = causal_lm.state_dict()
    for names in _layers(causal_lm).values():
        layer = {}
        for name in names:
            tensor = state[name]
            whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            if keeps:
                layer[name] = _snapshot(whole.detach().cpu(), live)
            del whole
        yield checkpoint_names(causal_lm, layer) if keeps else {}


def checkpoint_layout(causal_lm: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What ``gathered_layers`` yields, in its order, as tensors on the meta device (names, shapes and dtypes, no
    data), computed without a collective: the header of a version written as its layers arrive."""
    state = causal_lm.state_dict()
    layout: dict[str, torch.Tensor] = {}
    for names in _layers(causal_lm).values():
        layer = {name: torch.empty(state[name].shape, dtype=state[name].dtype, device="meta") for name in names}
        layout.update(checkpoint_names(causal_lm, layer))
    return layout


def checkpoint_names(causal_lm: Any, layer: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``layer`` (tensors of one decoder layer, or of the parameters outside every layer, under the names the model
    holds them by in memory) under its checkpoint's names and layout, as ``save_pretrained`` writes them:
    transformers' own inverse of the conversion it applied at load (``revert_weight_conversion``). Transformers 5
    holds a mixture of experts' weights fused, one 3-D tensor per layer (``mlp.experts.gate_up_proj``,
    ``mlp.experts.down_proj``); checkpoints, and so vLLM's loader, name one tensor per expert and projection. Dense
    layers come back as they are. An expert's tensors are views of the fused ones (no copy)."""
    from transformers.core_model_loading import revert_weight_conversion

    return dict(revert_weight_conversion(causal_lm, layer))


def _layers(causal_lm: torch.nn.Module) -> dict[str, list[str]]:
    """The names of the state dict's tensors (tied ones once, under their first name), by decoder layer, in the
    state dict's order."""
    aliases = {name for name, _ in causal_lm.named_parameters(remove_duplicate=False)}
    aliases -= {name for name, _ in causal_lm.named_parameters()}
    layers: dict[str, list[str]] = {}
    for name in causal_lm.state_dict():
        if name not in aliases:
            layers.setdefault(_layer_of(name), []).append(name)
    return layers


def _live_storages(causal_lm: torch.nn.Module) -> set[int]:
    return {_local(t).untyped_storage().data_ptr() for t in (*causal_lm.parameters(), *causal_lm.buffers())}


def _snapshot(tensor: torch.Tensor, live: set[int]) -> torch.Tensor:
    """``tensor``, copied if it is (a view of) a live parameter or buffer, whose storages are ``live``."""
    return tensor.clone() if tensor.untyped_storage().data_ptr() in live else tensor


def memory_names(causal_lm: Any, path: Path) -> dict[str, torch.Tensor]:
    """The tensors of the checkpoint-format safetensors file at ``path`` (a published version) under the names and
    layout ``causal_lm`` holds them in memory: the inverse of ``checkpoint_names``, by transformers' own loader (a
    model of ``causal_lm``'s config loaded from a directory of that config and the file), when the names differ."""
    tensors = load_file(str(path))
    if set(tensors) <= set(causal_lm.state_dict()):
        return tensors
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as directory:
        causal_lm.config.save_pretrained(directory)
        (Path(directory) / "model.safetensors").symlink_to(path.resolve())
        loaded = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    return dict(loaded.state_dict())


_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")


def _layer_of(name: str) -> str:
    """The decoder layer a parameter is in (``model.layers.3``), or "" for the parameters outside every layer."""
    match = _LAYER.match(name)
    return match.group(1) if match else ""


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's own part of a (possibly sharded) parameter or buffer."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def load_full_state_dict(causal_lm: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Load whole tensors that rank 0 holds (the other ranks pass nothing; a collective) into the shards: tied
    weights may be named once."""
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    set_model_state_dict(causal_lm, dict(tensors), options=options)
