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

A mixture-of-experts layer (vLLM's RoutedExperts: ``w13_weight`` stacks each expert's gate and up projections,
``w2_weight`` its down projection) is checked expert by expert (``check_experts``): its kernel, run with the routing
forced to that expert, against the expert computed from the published tensors, within EXPERT_TOLERANCE; and, where
vLLM keeps the parameters in its own layout, the parameters on the probed columns, exactly.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
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


EXPERT_TOLERANCE = 1e-4
"""The largest relative difference (to the largest value compared) between an expert's output through vLLM's kernel
and the expert computed from the published tensors in float64, in fp32; in a narrower dtype four of its epsilons
(bf16: 0.031, fp16: 0.0039), as the kernel rounds the activation and the output to it. Unlike a linear module's
one-hot product, the expert's activation and its down projection's sum are not exact, and their order is the
kernel's. Measured on vLLM's CPU kernel in fp32: 6.5e-7 for an expert loaded right; 2.0 for experts a reload left
in the wrong layout, 1.6 for a stale expert of another random model (bf16 not measured: this host's AMX kernel stops
on an illegal instruction)."""
VLLM_LAYOUT_BACKENDS = ("TRITON", "BATCHED_TRITON")
"""vLLM's unquantized expert backends that keep ``w13_weight`` and ``w2_weight`` as loaded ([experts, 2 x
intermediate, hidden], [experts, hidden, intermediate]); the others convert them to their kernel's layout (the CPU
backend prepacks them), so only the kernel's output can be compared there."""
GATED_ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
}
"""act in act(x·gateᵀ) * (x·upᵀ), by vLLM's MoEActivation value; experts with another activation are left
unchecked."""
TRANSFORMERS_FUSED = ("gate_up_proj", "down_proj")
"""transformers' names of a layer's experts fused in memory: [experts, 2 x intermediate, hidden] (gate then up),
[experts, hidden, intermediate]."""


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
            if _is_routed_experts(module):
                experts = check_experts(module, published, names)
                checked.update(experts)
                report.modules += bool(experts)
                continue
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


@dataclasses.dataclass(frozen=True)
class ExpertMatrix:
    """Where the published file holds one projection of one expert: the tensor ``name`` (at index ``expert`` of its
    first dimension when it stacks every expert, transformers' fused layout), from row ``offset`` on (the up half of
    a fused gate_up_proj)."""

    name: str
    expert: int | None = None
    offset: int = 0

    def read(self, published: Any, rows: tuple[int, int], columns: tuple[int, int]) -> torch.Tensor:
        """Rows ``[start, stop)`` and columns ``[start, stop)`` of the projection's matrix; only those are read."""
        tensor = published.get_slice(self.name)
        first, last = rows[0] + self.offset, rows[1] + self.offset
        matrix: torch.Tensor = (
            tensor[first:last, columns[0] : columns[1]]
            if self.expert is None
            else tensor[self.expert, first:last, columns[0] : columns[1]]
        )
        return matrix

    def __str__(self) -> str:
        if self.expert is None:
            return self.name
        return f"{self.name}[{self.expert}]{' (its up half)' if self.offset else ''}"


def published_experts(layer: Any, published: Any, names: set[str]) -> dict[int, tuple[ExpertMatrix, ...]] | None:
    """Each expert's (gate, up, down) projections in the published file, by its number: one tensor each under the
    checkpoint's names (``<layer>.<expert>.<name>.weight``, the names vLLM's layer loads: ``ckpt_gate_proj_name``
    and friends), or transformers' fused tensors (TRANSFORMERS_FUSED); None when the file has neither."""
    prefix, experts = layer.layer_name, range(layer.moe_config.num_logical_experts)
    own = (layer.ckpt_gate_proj_name, layer.ckpt_up_proj_name, layer.ckpt_down_proj_name)
    each = {e: tuple(ExpertMatrix(f"{prefix}.{e}.{projection}.weight") for projection in own) for e in experts}
    if all(matrix.name in names for matrices in each.values() for matrix in matrices):
        return each
    gate_up, down = (f"{prefix}.{name}" for name in TRANSFORMERS_FUSED)
    if gate_up in names and down in names and not layer.is_fused_checkpoint_transposed:
        half = published.get_slice(gate_up).get_shape()[1] // 2
        return {e: (ExpertMatrix(gate_up, e), ExpertMatrix(gate_up, e, half), ExpertMatrix(down, e)) for e in experts}
    return None


def check_experts(layer: Any, published: Any, names: set[str]) -> set[str]:
    """Check each expert of a mixture-of-experts layer that this worker holds against the published file; return the
    published tensors checked (none: the layer is left unchecked, reported). Raises LoadMismatch naming the layer and
    the expert.

    Its kernel is run with the routing forced to the expert, on a few probed columns of the hidden state: an input
    that is zero but at one column (scaled by a power of two for an activation of order one, where silu tells gate
    from up) gives ``act(gate[:, j]) * up[:, j]`` exactly after the first product, and the output's probed rows are
    compared with the published down projection's rows applied to it. With tensor parallelism the worker holds a
    slice of each expert's intermediate rows, which its kernel sums over (vLLM reduces after the kernel). Left
    unchecked: a kernel this check does not know (quantized, monolithic, biased, another activation, rearranged by
    EPLB) and, for the kernel, expert parallelism (its kernel dispatches across workers; the parameters are still
    compared where vLLM keeps its layout)."""
    method, config = layer.quant_method, layer.moe_config
    parallel = config.moe_parallel_config
    experts = published_experts(layer, published, names)
    activation = GATED_ACTIVATIONS.get(getattr(config.activation, "value", ""))
    backend = getattr(getattr(method, "unquantized_backend", None), "name", None)
    if (
        experts is None
        or backend is None
        or activation is None
        or not config.is_act_and_mul
        or config.has_bias
        or parallel.enable_eplb
    ):
        return set()
    run_kernel = not (method.is_monolithic or parallel.use_ep or parallel.dp_size > 1)
    compare_parameters = backend in VLLM_LAYOUT_BACKENDS
    if not (run_kernel or compare_parameters):
        return set()
    held = layer.expert_map_manager.get_local_expert_ids()
    gate_shape = published.get_slice(experts[0][0].name).get_shape()
    intermediate, width = gate_shape[-2] // (2 if experts[0][0].expert is not None else 1), gate_shape[-1]
    per_rank = intermediate // parallel.tp_size
    rows = (parallel.tp_rank * per_rank, (parallel.tp_rank + 1) * per_rank)
    probes = sorted({round(i * (width - 1) / max(PROBE_COLUMNS - 1, 1)) for i in range(PROBE_COLUMNS)})
    dtype = layer.w2_weight.dtype
    checked: set[str] = set()
    for expert in held:
        gate, up, down = experts[expert]
        columns = [  # [intermediate rows held, probes] of gate and up, [probes, intermediate rows held] of down
            torch.cat([matrix.read(published, rows, (j, j + 1)) for j in probes], 1).to(dtype) for matrix in (gate, up)
        ]
        down_rows = torch.cat([down.read(published, (r, r + 1), rows) for r in probes]).to(dtype)
        what = f"{gate} + {up} + {down}"
        if compare_parameters:
            _compare_expert_parameters(layer, expert, columns, down_rows, probes, what)
        if run_kernel:
            _compare_expert_kernel(layer, expert, columns, down_rows, probes, activation, what)
        checked.update(matrix.name for matrix in (gate, up, down))
    if len(held) < len(experts):  # a fused tensor stacks experts this worker does not hold
        checked -= {matrix.name for matrix in experts[0] if matrix.expert is not None}
    return checked


def _is_routed_experts(module: Any) -> bool:
    """vLLM's RoutedExperts: a mixture-of-experts layer's experts, stacked in ``w13_weight`` and ``w2_weight``."""
    return all(hasattr(module, name) for name in ("w13_weight", "w2_weight", "quant_method", "layer_name"))


def _compare_expert_parameters(
    layer: Any, expert: int, columns: list[torch.Tensor], down_rows: torch.Tensor, probes: list[int], what: str
) -> None:
    """The expert's stacked parameters on the probed columns (gate, then up, as vLLM stacks them in ``w13_weight``;
    the probed rows of ``w2_weight``), exactly, where vLLM keeps its own layout."""
    local = layer.expert_map_manager.map_global_to_local(expert)
    w13, w2 = layer.w13_weight.detach()[local], layer.w2_weight.detach()[local]
    held, half = columns[0].shape[0], w13.shape[0] // 2  # half: the intermediate size, padded
    if not (
        torch.equal(w13[:held, probes], columns[0])
        and torch.equal(w13[half : half + held, probes], columns[1])
        and torch.equal(w2[probes, :held], down_rows)
    ):
        raise LoadMismatch(f"{layer.layer_name}: expert {expert}'s weights are not the published {what} after the load")


def _compare_expert_kernel(
    layer: Any,
    expert: int,
    columns: list[torch.Tensor],
    down_rows: torch.Tensor,
    probes: list[int],
    activation: Any,
    what: str,
) -> None:
    """The layer's kernel, routed to ``expert`` alone with weight 1, on inputs that are zero but at one probed column
    each, against the expert computed from the published tensors in float64 (EXPERT_TOLERANCE)."""
    gate, up = (part.double() for part in columns)
    largest = gate.abs().amax(0)
    scale = torch.where(largest > 0, torch.exp2(torch.round(-torch.log2(largest))), 1.0)  # exact: a power of two
    expected = down_rows.double() @ (activation(gate * scale) * (up * scale))  # [output rows, inputs]
    dtype = layer.w2_weight.dtype
    inputs = torch.zeros(len(probes), layer.hidden_size, dtype=dtype, device=layer.w2_weight.device)
    inputs[range(len(probes)), probes] = scale.to(dtype)
    routed = torch.full((len(probes), 1), expert, dtype=torch.int32, device=inputs.device)
    weights = torch.ones(len(probes), 1, dtype=torch.float32, device=inputs.device)
    with torch.no_grad():
        output = layer.quant_method.apply(layer, inputs, weights, routed, None, None)
    computed = output[:, probes].T.double().cpu()
    difference = ((computed - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()
    tolerance = max(EXPERT_TOLERANCE, 4 * torch.finfo(dtype).eps)
    if not difference <= tolerance:  # NaN too
        raise LoadMismatch(
            f"{layer.layer_name}: expert {expert} computes with weights other than the published {what} after the "
            f"load (relative difference {difference:.3g}, rounding explains {tolerance:.2g}): its kernel's copy is "
            "stale or in another layout"
        )
