"""What the actor checks inside each vLLM worker after loading a weights version, before it may resume: that the
engine computes with the published tensors, derived copies included.

vLLM derives state from the weights at load time: on its CPU backend each linear module keeps a repacked copy that
its kernel reads, a tied head shares the embeddings' parameter, fused modules (qkv_proj, gate_up_proj) stack
several checkpoint tensors. A reload that misses one of these serves a mix of versions with no error. So for
every module with a weight the check compares, on a few columns, the parameter (where vLLM keeps it) and what the
module computes (its kernel applied to one-hot inputs, which returns those columns exactly) with the published
tensors, fused ones concatenated as vLLM stacks them (and their biases, whole); every other parameter the file
names is compared whole. A difference raises LoadMismatch naming the module. It reads only the probed columns of
the file (and the biases), and costs one small product per module.

With tensor parallelism each worker holds a shard of most modules, and checks that shard: the rows of each published
tensor it holds (column-parallel modules, fused ones per part, a vocabulary-parallel embedding or head) or the
columns (row-parallel ones), as vLLM's own attributes on the module say (``shard_of``). The CPU backend empties a
linear module's parameter, so the module, not its weight's shape, says what the worker holds.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

PROBE_COLUMNS = 4
"""Columns of each weight matrix checked: a stale or half-loaded matrix differs in nearly every column."""


@dataclasses.dataclass(frozen=True)
class Shard:
    """What one worker holds of a module's published tensors: rows ``[start, stop)`` of each, stacked in order, and
    columns ``[start, stop)`` of all."""

    rows: list[tuple[int, int]]
    columns: tuple[int, int]


def shard_of(module: Any, shapes: list[tuple[int, int]]) -> Shard:
    """The shard of the published tensors of ``shapes`` (stacked as vLLM stacks them) that ``module`` holds, from
    vLLM's attributes on it: ``tp_rank``/``tp_size``; a vocabulary-parallel embedding's ``shard_indices``; a
    row-parallel module's ``input_size_per_partition``; a column-parallel one's ``output_partition_sizes``, one per
    tensor (a key or value projection with fewer heads than ranks: ranks share a shard, as vLLM replicates it)."""
    width = shapes[0][1]
    whole = Shard([(0, shape[0]) for shape in shapes], (0, width))
    size, rank = getattr(module, "tp_size", 1), getattr(module, "tp_rank", 0)
    if size == 1:
        return whole
    indices = getattr(module, "shard_indices", None)
    if indices is not None:
        return Shard([(indices.org_vocab_start_index, indices.org_vocab_end_index)], (0, width))
    per_rank_columns = getattr(module, "input_size_per_partition", width)
    if per_rank_columns < width:
        return Shard(whole.rows, (rank * per_rank_columns, (rank + 1) * per_rank_columns))
    partitions = getattr(module, "output_partition_sizes", None)
    if partitions is None or len(partitions) != len(shapes):
        partitions = [shape[0] // size for shape in shapes]
    rows = []
    for (total, _), per_rank in zip(shapes, partitions, strict=True):
        shard = rank * (total // per_rank) // size  # ranks that share a replicated shard read the same rows
        rows.append((shard * per_rank, (shard + 1) * per_rank))
    return Shard(rows, (0, width))


class LoadMismatch(RuntimeError):
    """The engine does not compute with the published tensors; the message names the module."""


@dataclasses.dataclass
class LoadReport:
    """What a check compared: modules through their kernels, other parameters whole, and the published tensors
    that no module of this worker holds (a tensor-parallel shard, a name vLLM maps differently)."""

    modules: int = 0
    parameters: int = 0
    unchecked: list[str] = dataclasses.field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"modules": self.modules, "parameters": self.parameters, "unchecked": self.unchecked}


def tied_groups(model: torch.nn.Module) -> list[list[str]]:
    """The names of modules that share one weight parameter (a head tied to the embeddings), each group in module
    order: the first is the one a checkpoint names."""
    groups: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.nn.Parameter):
            groups.setdefault(id(weight), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def retie(model: torch.nn.Module, groups: list[list[str]]) -> None:
    """Tie each group's modules to its first one's (reloaded) parameter again, and let vLLM derive their state from
    it anew (process_weights_after_loading: the CPU backend's repacked copy)."""
    for source_name, *names in groups:
        source = model.get_submodule(source_name)
        for name in names:
            module = model.get_submodule(name)
            module.weight = source.weight
            method = getattr(module, "quant_method", None)
            if method is not None:
                method.process_weights_after_loading(module)


def check_loaded(model: torch.nn.Module, path: Path, tied: list[list[str]]) -> LoadReport:
    """Compare ``model`` with the tensors of the safetensors file at ``path``; raise LoadMismatch at the first
    module or parameter that differs."""
    packed: dict[str, list[str]] = getattr(model, "packed_modules_mapping", {}) or {}
    tied_to = {name: group[0] for group in tied for name in group[1:]}
    report = LoadReport()
    with safe_open(str(path), "pt") as published:
        names = set(published.keys())
        checked: set[str] = set()
        for module_name, module in model.named_modules():
            weight = getattr(module, "weight", None)
            if not (isinstance(weight, torch.Tensor) and hasattr(module, "quant_method")):
                continue
            sources = _published_names(module_name, packed, tied_to, names)
            if sources is None:
                continue
            shapes = [tuple(published.get_slice(name).get_shape()) for name in sources]
            shard = shard_of(module, shapes)
            first, last = shard.columns
            rows, width = sum(stop - start for start, stop in shard.rows), last - first
            if weight.ndim == 2 and weight.numel() and (width != weight.shape[1] or rows > weight.shape[0]):
                continue  # sharded in a way shard_of does not know: left unchecked, reported
            columns = sorted({round(i * (width - 1) / max(PROBE_COLUMNS - 1, 1)) for i in range(PROBE_COLUMNS)})
            expected = torch.cat(  # only the probed rows and columns are read, not the whole tensors
                [
                    torch.cat([published.get_slice(name)[start:stop, first + j : first + j + 1] for j in columns], 1)
                    for name, (start, stop) in zip(sources, shard.rows, strict=True)
                ]
            )
            _check_module(module_name, module, weight, expected, columns, width, sources)
            checked.update(sources)
            report.modules += 1
            biases = [name.removesuffix(".weight") + ".bias" for name in sources]
            bias = getattr(module, "bias", None)
            if isinstance(bias, torch.Tensor) and all(name in names for name in biases):
                published_bias = torch.cat(  # a row-parallel module's bias is whole: its shard has every row
                    [
                        published.get_slice(name)[start:stop]
                        for name, (start, stop) in zip(biases, shard.rows, strict=True)
                    ]
                ).to(bias.dtype)
                if bias.shape == published_bias.shape:  # else sharded in a way shard_of does not know
                    if not torch.equal(bias.detach(), published_bias):
                        raise LoadMismatch(f"{module_name}: its bias is not the published {' + '.join(biases)}")
                    checked.update(biases)
                    report.parameters += 1
        for name, parameter in model.named_parameters():
            if (
                name in names
                and name not in checked
                and tuple(parameter.shape) == tuple(published.get_slice(name).get_shape())
            ):
                if not torch.equal(parameter.detach(), published.get_tensor(name).to(parameter.dtype)):
                    raise LoadMismatch(f"{name} differs from the published tensor of the same name after the load")
                checked.add(name)
                report.parameters += 1
        report.unchecked = sorted(names - checked)
    return report


def _published_names(
    module_name: str, packed: dict[str, list[str]], tied_to: dict[str, str], names: set[str]
) -> list[str] | None:
    """The published tensors a module holds, in the order vLLM stacks them; None when the file names none."""
    prefix, _, leaf = module_name.rpartition(".")
    parts = [f"{prefix}.{part}.weight" if prefix else f"{part}.weight" for part in packed.get(leaf, [leaf])]
    if all(name in names for name in parts):
        return parts
    own = f"{module_name}.weight"
    if own not in names and module_name in tied_to and f"{tied_to[module_name]}.weight" in names:
        return [f"{tied_to[module_name]}.weight"]
    return None


def _check_module(
    name: str,
    module: torch.nn.Module,
    weight: torch.Tensor,
    expected: torch.Tensor,
    columns: list[int],
    width: int,
    sources: list[str],
) -> None:
    """``expected``: the published ``columns`` of the module's weight (``width`` wide), stacked as vLLM stacks
    ``sources``."""
    rows = expected.shape[0]
    want = expected.to(weight.dtype)
    what = " + ".join(sources)
    # The CPU backend keeps only its repacked copy of a linear module's weight (the parameter is emptied).
    if weight.ndim == 2 and not torch.equal(weight.detach()[:rows, columns], want):
        raise LoadMismatch(f"{name}: its weight is not the published {what} after the load")
    one_hot = torch.zeros(len(columns), width, dtype=weight.dtype, device=weight.device)
    one_hot[range(len(columns)), columns] = 1
    with torch.no_grad():
        kernel: Any = module.quant_method
        computed = kernel.apply(module, one_hot)[:, :rows].T
    if not torch.equal(computed, want):
        largest = (computed.float() - want.float()).abs().max().item()
        raise LoadMismatch(
            f"{name}: vLLM computes with weights other than the published {what} after the load (largest "
            f"difference {largest:.3g}): a copy vLLM derived at load time was not refreshed"
        )
