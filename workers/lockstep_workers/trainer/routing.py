"""Routing in the trainer's mixture-of-experts layers: each token's top-k experts in each MoE layer, recorded from the
trainer's own routers or replayed from the rollout engine's (routing replay, R3), the metrics of routing, and the
routers' auxiliary load-balancing loss.

A family is supported by naming its transformers router class in ROUTERS, with how it renormalizes its top-k
probabilities. Its router returns ``(router_logits, top_k_weights, top_k_indices)`` over the flattened batch
([batch * length] rows); ``routed`` wraps it with a forward hook that records its choice and, replaying, returns the
given experts instead, weighted by the router's own softmax probabilities there (renormalized as the family does),
so that the gradient reaches the router as in verl's and miles' replay. Nothing of the modeling code is copied.

Given routings (``engine_routing``) are vLLM's ``CompletionOutput.routed_experts`` of each sequence: [tokens, MoE
layers, top_k] from the sequence's first token (the prompt's), prompt + completion - 1 rows (the last token is never
fed back to the engine); the positions without one (the last token, padding) keep the trainer's own choice, which
reaches no scored token.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

ROUTING_MISMATCH = "routing_mismatch"
"""The fraction of (token, MoE layer) pairs with an engine routing where the trainer's own top-k set differs from
the engine's: the MoE analogue of the on-policy |Δlogprob|."""
EXPERT_LOAD_IMBALANCE = "expert_load_imbalance"
"""Per MoE layer, the most tokens any expert computed over the mean per expert (1: even; the number of experts:
all on one), averaged over the layers; over the step's tokens (prompts and completions, no padding), routed as the
trainer computed them (the replayed experts under replay)."""
TOKENS_DROPPED = "tokens_dropped"
"""Tokens an expert's capacity turned away: None (null) for every family in ROUTERS, which drop none."""
ROUTER_AUX_LOSS = "router_aux_loss"
"""The family's load-balancing loss (transformers' ``load_balancing_loss_func``) before its coefficient, averaged
over micro-batches; only with spec.trainer.objective.routerAuxLossCoefficient."""

_LOAD = "routing_load/"  # statistics: routing_load/<layer>/<expert> tokens
_MISMATCHED, _COMPARED = "routing_mismatched", "routing_compared"
_AUX, _AUX_SEQUENCES = "router_aux_loss", "router_aux_sequences"


def _by_config(router: Any) -> bool:
    return bool(router.norm_topk_prob)


def _always(router: Any) -> bool:
    return True


ROUTERS: dict[str, Callable[[Any], bool]] = {
    "Qwen3MoeTopKRouter": _by_config,
    "Qwen2MoeTopKRouter": _by_config,  # its shared expert is beside the router, untouched
    "OlmoeTopKRouter": _by_config,
    "MixtralTopKRouter": _always,
}
"""The router classes (transformers) of the supported MoE families, each with whether it renormalizes its top-k
probabilities to sum to 1 (config.norm_topk_prob, or always)."""


def routers(causal_lm: torch.nn.Module) -> list[torch.nn.Module]:
    """The MoE routers of ``causal_lm`` in layer order (its MoE layers'; empty for a dense model)."""
    return [module for module in causal_lm.modules() if type(module).__name__ in ROUTERS]


def over_moe_layers(routing: torch.Tensor, causal_lm: torch.nn.Module) -> torch.Tensor:
    """An engine routing ([tokens, layers, top_k]) over ``causal_lm``'s MoE layers alone, as ``routed`` takes it.
    vLLM may lay its routed experts out over every decoder layer (its RoutedExpertsCapturer sizes that axis by the
    model's layers and leaves a dense layer's rows 0: read in vLLM 0.32's source, not yet seen on a GPU;
    e2e/gpu/replay.py reports which): on a model with dense layers among its MoE ones those rows are dropped. Any
    other layout is returned as it is (``routed`` refuses one that does not fit)."""
    layers = moe_layers(causal_lm)
    decoder_layers = getattr(getattr(causal_lm, "config", None), "num_hidden_layers", None)
    if routing.shape[1] == decoder_layers != len(layers):
        return routing[:, layers]
    return routing


def moe_layers(causal_lm: torch.nn.Module) -> list[int]:
    """The decoder-layer number of each of ``causal_lm``'s MoE layers, in ``routers``' order."""
    names = [name for name, module in causal_lm.named_modules() if type(module).__name__ in ROUTERS]
    return [int(name.split("layers.")[1].split(".")[0]) for name in names]


@dataclass
class Routed:
    """What the MoE layers did in the forward passes within one ``routed``, by MoE layer: ``own``, each token's
    top-k by the trainer's router ([tokens, top_k]); ``used``, the experts computed (the replayed ones where given);
    ``logits``, the router logits with their gradient (only when kept)."""

    own: dict[int, torch.Tensor] = field(default_factory=dict)
    used: dict[int, torch.Tensor] = field(default_factory=dict)
    logits: dict[int, torch.Tensor] = field(default_factory=dict)


@contextlib.contextmanager
def routed(
    moe: Sequence[torch.nn.Module],
    engine: torch.Tensor | None = None,
    *,
    replay: bool = False,
    keep_logits: bool = False,
) -> Iterator[Routed]:
    """Within: the forward passes through the routers ``moe`` (``routers``' list) are recorded; with ``replay`` each
    token with an ``engine`` routing ([tokens, MoE layers, top_k], tokens the forward's flattened batch, -1 where
    none) is computed by those experts, weighted by the router's softmax probabilities of them (renormalized as the
    family does), the gradient flowing to the router. A pass recomputed in the backward (activation checkpointing)
    routes alike, so the backward must run within too. Raises ValueError when ``engine`` does not fit the model."""
    if replay and engine is not None and not moe:
        raise ValueError("routing replay was asked for, but this model has no router that the trainer can replay")
    if engine is not None and moe and engine.shape[1:] != (len(moe), _top_k(moe[0])):
        raise ValueError(
            f"the engine's routed experts have {engine.shape[1]} layers of top-{engine.shape[2]}; this model has "
            f"{len(moe)} MoE layers of top-{_top_k(moe[0])}: the actors serve another model than the trainer's"
        )
    record = Routed()
    handles = [
        router.register_forward_hook(_hook(layer, record, engine if replay else None, keep_logits))
        for layer, router in enumerate(moe)
    ]
    try:
        yield record
    finally:
        for handle in handles:
            handle.remove()


def _top_k(router: Any) -> int:
    top_k: int = router.top_k
    return top_k


def _experts(router: Any) -> int:
    experts: int = router.num_experts
    return experts


def _hook(
    layer: int, record: Routed, engine: torch.Tensor | None, keep_logits: bool
) -> Callable[[torch.nn.Module, Any, Any], Any]:
    def hook(router: torch.nn.Module, inputs: Any, output: Any) -> Any:
        logits, weights, own = output
        record.own[layer] = own.detach()
        if keep_logits:
            record.logits[layer] = logits
        if engine is None:
            record.used[layer] = own.detach()
            return None
        given = engine[:, layer].to(own.device)
        chosen = torch.where(given >= 0, given, own)
        replayed = logits.float().softmax(dim=-1).gather(1, chosen)
        if ROUTERS[type(router).__name__](router):
            replayed = replayed / replayed.sum(dim=-1, keepdim=True)
        record.used[layer] = chosen
        return logits, replayed.to(weights.dtype), chosen

    return hook


def engine_routing(
    sequences: Sequence[torch.Tensor | None], longest: int, device: torch.device | None = None
) -> torch.Tensor | None:
    """The engine routings of a batch's sequences (each [tokens, MoE layers, top_k], or None), laid out as the
    forward flattens the batch (row n's token t at n * ``longest`` + t), -1 where there is none; None when no
    sequence has one. A routing longer than ``longest`` is cut."""
    shapes = {tuple(s.shape[1:]) for s in sequences if s is not None}
    if not shapes:
        return None
    if len(shapes) > 1:
        raise ValueError(f"the samples' routed experts differ in shape ({sorted(shapes)}): they come from one model")
    ((layers, top_k),) = shapes
    flat = torch.full((len(sequences), longest, layers, top_k), -1, dtype=torch.long)
    for row, routing in enumerate(sequences):
        if routing is not None:
            flat[row, : min(len(routing), longest)] = routing[:longest].long()
    return flat.flatten(0, 1).to(device)


def routing_statistics(
    moe: Sequence[torch.nn.Module], record: Routed, counted: torch.Tensor, engine: torch.Tensor | None
) -> dict[str, float]:
    """Additive statistics of one forward (lockstep_workers.trainer.objective.Statistics sums): each expert's tokens per
    MoE layer among the ``counted`` ones ([tokens] bool: not padding), and with an ``engine`` routing the (token, layer)
    pairs compared and those whose top-k sets differ."""
    sums: dict[str, float] = {}
    for layer, router in enumerate(moe):
        used = record.used[layer][counted.to(record.used[layer].device)]
        load = torch.bincount(used.flatten(), minlength=_experts(router)).tolist()
        sums |= {f"{_LOAD}{layer}/{expert}": float(tokens) for expert, tokens in enumerate(load)}
    sums |= {_MISMATCHED: 0.0, _COMPARED: 0.0}  # every rank's statistics have the same names (across_ranks)
    if engine is not None:
        given = engine[:, 0, 0] >= 0
        own = torch.stack([record.own[layer] for layer in range(len(moe))], dim=1).cpu()[given.cpu()]
        theirs = engine[given].cpu()
        differs = (own.sort(dim=-1).values != theirs.sort(dim=-1).values).any(dim=-1)
        sums |= {_MISMATCHED: float(differs.sum()), _COMPARED: float(differs.numel())}
    return sums


def routing_metrics(sums: Mapping[str, float]) -> dict[str, float]:
    """The routing metrics of a step's statistics (``routing_statistics``' and ``aux_statistics``' sums, over
    micro-batches and ranks): EXPERT_LOAD_IMBALANCE, ROUTING_MISMATCH when there were engine routings (else absent:
    null), ROUTER_AUX_LOSS when it was computed; none for a dense model."""
    layers: dict[str, list[float]] = {}
    for name, tokens in sums.items():
        if name.startswith(_LOAD):
            layers.setdefault(name.removeprefix(_LOAD).split("/")[0], []).append(tokens)
    if not layers:
        return {}
    ratios = [max(load) * len(load) / sum(load) for load in layers.values() if sum(load)]
    out = {EXPERT_LOAD_IMBALANCE: sum(ratios) / len(ratios)} if ratios else {}
    if sums.get(_COMPARED):
        out[ROUTING_MISMATCH] = sums[_MISMATCHED] / sums[_COMPARED]
    if sums.get(_AUX_SEQUENCES):
        out[ROUTER_AUX_LOSS] = sums[_AUX] / sums[_AUX_SEQUENCES]
    return out


def unmeasured(metrics: Mapping[str, float]) -> dict[str, None]:
    """The routing metrics an MoE step's ``metrics`` (those with EXPERT_LOAD_IMBALANCE) measured nothing for, as
    None, for metrics.jsonl's null: ROUTING_MISMATCH without engine routings, and TOKENS_DROPPED always."""
    if EXPERT_LOAD_IMBALANCE not in metrics:
        return {}
    return {name: None for name in (ROUTING_MISMATCH, TOKENS_DROPPED) if name not in metrics}


def aux_statistics(loss: float, sequences: int) -> dict[str, float]:
    """Additive statistics of one micro-batch's aux loss (``aux_loss``), weighted by its ``sequences``."""
    return {_AUX: loss * sequences, _AUX_SEQUENCES: float(sequences)}


def aux_loss(moe: Sequence[torch.nn.Module], record: Routed, attention: torch.Tensor) -> torch.Tensor:
    """The family's load-balancing loss (its transformers module's ``load_balancing_loss_func``, as the model's own
    forward computes it with output_router_logits) of the logits ``record`` kept, over the tokens where
    ``attention`` ([sequences, length]) is 1."""
    family = sys.modules[type(moe[0]).__module__]
    logits = tuple(record.logits[layer] for layer in range(len(moe)))
    loss: torch.Tensor = family.load_balancing_loss_func(logits, _experts(moe[0]), _top_k(moe[0]), attention)
    return loss
