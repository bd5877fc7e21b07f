"""The learner: token logprobs of sampled completions, group-normalised advantages, and ``learn``, the optimiser
steps on one batch of rollouts.

The same code runs on one process or on every rank of a sharded trainer (lockstep_workers.trainer.sharding): each rank
learns from its own prompt groups; the loss of every micro-batch is scaled so that the gradients FSDP averages
over the ranks, accumulated over a minibatch's micro-batches, are those of the whole minibatch in one pass. Every
tensor is made on the policy's device; collectives carry only tensors on it (CUDA tensors on NCCL).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from lockstep.api import AdvantageEstimator, Objective
from lockstep_workers.rollout.record import Rollout, lag_of
from lockstep_workers.trainer import routing
from lockstep_workers.trainer.objective import Batch, Statistics, loss_denominator, policy_loss
from lockstep_workers.trainer.optimization import SkippedSteps, clip_gradients
from lockstep_workers.weights import lora

HEAD_CHUNK_TOKENS = 4096
"""Completion tokens per slice of the final projection. The [tokens, vocabulary] fp32 logits of one slice are the
largest tensor the head makes (0.5 GiB with a 32k vocabulary); with gradient they are recomputed in the backward
pass rather than kept, so the logits of the whole batch never exist at once."""


def top_p_masked(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """``logits`` with the tokens outside the nucleus set to -inf, as vLLM's sampler does it: sorted by
    probability, a token goes when the tokens less likely than it, and it, hold at most 1 - top_p."""
    ordered, order = logits.sort(dim=-1)
    outside = ordered.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
    outside[..., -1] = False
    return logits.masked_fill(outside.scatter(-1, order, outside), float("-inf"))


HeadAdapter = tuple[torch.Tensor, torch.Tensor, float, Callable[[torch.Tensor], torch.Tensor]]
"""A LoRA adapter on the lm_head (spec.trainer.lora.trainLmHead): its A [r, hidden] and B [vocabulary, r]
weights, its scaling (alpha / r) and its dropout."""


def head_adapter(lm_head: torch.nn.Module) -> HeadAdapter | None:
    """The active LoRA adapter on ``lm_head`` (PEFT's LoRA layer around the head: its ``weight`` is the base's
    alone), or None for a plain head or one whose adapter is merged or disabled."""
    if not hasattr(lm_head, "lora_A") or getattr(lm_head, "merged", False) or getattr(lm_head, "disable_adapters", 0):
        return None
    active: Any = lm_head
    adapters = [name for name in active.active_adapters if name in active.lora_A]
    if len(adapters) != 1:
        raise ValueError(f"the lm_head has {len(adapters)} active LoRA adapters; the trainer computes with one")
    (name,) = adapters
    return active.lora_A[name].weight, active.lora_B[name].weight, active.scaling[name], active.lora_dropout[name]


def _log_softmax(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    temperature: float,
    top_p: float,
    fp32_head: bool,
    adapter: HeadAdapter | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """[tokens, vocabulary] log-probabilities after the sampler's transform, from the final hidden states; with a
    LoRA ``adapter`` on the head, its term is added to the logits in the head's dtype, as PEFT's LoRA layer adds it;
    with ``soft_cap`` (Gemma 2's final_logit_softcapping) the logits become ``soft_cap * tanh(logits / soft_cap)``
    before the temperature, as the model's own forward and vLLM's logits processor do."""
    if fp32_head:
        hidden, weight = hidden.float(), weight.float()
    logits = F.linear(hidden, weight)
    if adapter is not None:
        lora_a, lora_b, scaling, dropout = adapter
        if fp32_head:
            lora_a, lora_b = lora_a.float(), lora_b.float()
        logits = logits + F.linear(F.linear(dropout(hidden), lora_a), lora_b) * scaling
    logits = logits.float()
    if soft_cap:
        logits = torch.tanh(logits / soft_cap) * soft_cap
    logits = logits / temperature
    if top_p < 1:
        logits = top_p_masked(logits, top_p)
    return logits.log_softmax(dim=-1)


def _sampled(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    top_p: float,
    fp32_head: bool,
    adapter: HeadAdapter | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    scores = _log_softmax(hidden, weight, temperature, top_p, fp32_head, adapter, soft_cap)
    return scores.gather(1, targets[:, None])[:, 0]


class Policy(torch.nn.Module):
    """A Hugging Face causal LM (``causal_lm``) that scores sampled tokens: ``forward`` returns the log-probability
    of each target token after the sampler's transform (temperature, then top-p), and optionally the entropy there,
    computing the head and the log-softmax only at the completion positions and a slice at a time. The final
    projection runs in fp32 when ``fp32_head`` (the ParityPolicy's trainer.lmHeadDtype), as the rollout engine's;
    a LoRA adapter on the head (spec.trainer.lora.trainLmHead) computes in the head's dtype too.

    Sharded, this module is the root FSDP unit: its own parameters (embeddings, lm_head) are gathered in its forward.
    """

    causal_lm: Any  # a Hugging Face model (untyped)

    def __init__(self, causal_lm: torch.nn.Module, *, fp32_head: bool = True) -> None:
        super().__init__()
        self.causal_lm = causal_lm
        self.fp32_head = fp32_head
        self.soft_cap: float | None = getattr(getattr(causal_lm, "config", None), "final_logit_softcapping", None)
        """The model's final logit soft-capping (Gemma 2), applied as its own forward applies it."""

    def forward(
        self,
        ids: torch.Tensor,
        attention: torch.Tensor,
        positions: torch.Tensor,
        targets: torch.Tensor,
        temperature: float,
        top_p: float = 1.0,
        with_entropy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``ids``, ``attention``: [sequences, length]; ``positions``: flat indices into them of the tokens that
        predict ``targets``. Returns the targets' logprobs [targets] and, ``with_entropy``, the entropies there."""
        hidden = self.causal_lm.model(input_ids=ids, attention_mask=attention).last_hidden_state
        hidden = hidden.flatten(0, 1)[positions]
        weight = self.causal_lm.lm_head.weight  # a LoRA layer's: its base layer's
        adapter = head_adapter(self.causal_lm.lm_head)
        logprobs, entropies = [], []
        for start in range(0, len(targets), HEAD_CHUNK_TOKENS):
            part, chosen = hidden[start : start + HEAD_CHUNK_TOKENS], targets[start : start + HEAD_CHUNK_TOKENS]
            if torch.is_grad_enabled() and not with_entropy:
                arguments = (part, weight, chosen, temperature, top_p, self.fp32_head, adapter, self.soft_cap)
                logprobs.append(checkpoint(_sampled, *arguments, use_reentrant=False))
                continue
            scores = _log_softmax(part, weight, temperature, top_p, self.fp32_head, adapter, self.soft_cap)
            logprobs.append(scores.gather(1, chosen[:, None])[:, 0])
            if with_entropy:
                entropies.append(-(scores.exp() * scores.nan_to_num(neginf=0.0)).sum(dim=-1))
        return torch.cat(logprobs), torch.cat(entropies) if with_entropy else None


def device_of(policy: torch.nn.Module) -> torch.device:
    """Where ``policy`` computes: its parameters' device, or with parameters sharded over a CUDA device mesh
    (FSDP2) this rank's GPU, also when they wait in host memory between passes (CPU offload)."""
    parameter = next(policy.parameters())
    mesh = getattr(parameter, "device_mesh", None)
    if mesh is not None and mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return parameter.device


def token_logprobs(
    policy: Policy,
    rollouts: Sequence[Rollout],
    temperature: float,
    *,
    top_p: float = 1.0,
    with_entropy: bool = False,
    width: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Logprobs of each completion token under ``policy`` after the sampler's transform, their entropies (when
    ``with_entropy``; with gradient when it is enabled) and the completion mask, all [sequences, ``width`` or the
    longest completion] on the policy's device. A token outside the trainer's top-p set gets -inf."""
    device = device_of(policy)
    attention = attention_mask(rollouts)
    longest = attention.shape[1]
    width = width or max(len(r.completion) for r in rollouts)
    ids = torch.zeros(len(rollouts), longest, dtype=torch.long)
    mask = torch.zeros(len(rollouts), width)
    positions: list[int] = []
    targets: list[int] = []
    for row, r in enumerate(rollouts):
        sequence = r.prompt + r.completion
        ids[row, : len(sequence)] = torch.tensor(sequence)
        start = row * longest + len(r.prompt) - 1
        positions += range(start, start + len(r.completion))
        targets += r.completion
        mask[row, : len(r.completion)] = 1
    ids, mask = ids.to(device), mask.to(device)
    scored, entropy = policy(
        ids,
        attention.to(device),
        torch.tensor(positions, device=device),
        torch.tensor(targets, device=device),
        temperature,
        top_p,
        with_entropy,
    )
    where = mask.bool()
    logprobs = torch.zeros(mask.shape, device=device, dtype=scored.dtype).masked_scatter(where, scored)
    entropies = None if entropy is None else torch.zeros_like(mask).masked_scatter(where, entropy)
    return logprobs, entropies, mask


def attention_mask(rollouts: Sequence[Rollout]) -> torch.Tensor:
    """[sequences, longest] 1 at each sequence's tokens (prompt and completion), 0 at the padding after them: how
    ``token_logprobs`` lays out a batch."""
    lengths = torch.tensor([[len(r.prompt) + len(r.completion)] for r in rollouts])
    return (torch.arange(int(lengths.max())) < lengths).long()


@contextlib.contextmanager
def _routed(
    moe: list[torch.nn.Module],
    rollouts: Sequence[Rollout],
    replay: bool,
    device: torch.device,
    *,
    keep_logits: bool = False,
    measured: dict[str, float] | None = None,
) -> Iterator[routing.Routed]:
    """Within: ``token_logprobs`` of ``rollouts`` routes through the MoE routers ``moe`` as
    lockstep_workers.trainer.routing.routed does (replaying the rollouts' engine routings with ``replay``); after it,
    the statistics of its routing are added to ``measured`` (a dense model's ``moe`` is empty: nothing is recorded)."""
    attention = attention_mask(rollouts)
    routings = [r.routed_experts for r in rollouts]
    engine = routing.engine_routing(routings, attention.shape[1], device) if moe else None
    with routing.routed(moe, engine, replay=replay, keep_logits=keep_logits) as record:
        yield record
    if moe and measured is not None:
        found = routing.routing_statistics(moe, record, attention.flatten().bool(), engine)
        measured.update({name: measured.get(name, 0.0) + value for name, value in found.items()})


def group_advantages(
    rewards: torch.Tensor, groups: torch.Tensor, estimator: AdvantageEstimator = AdvantageEstimator.GRPO
) -> torch.Tensor:
    """Each reward against its group's (``estimator`` grpo, dr_grpo or rloo, docs/recipes.md): grpo, minus the
    group's mean, over its population standard deviation (divided by the group's size, not size - 1 as verl's
    sample one is) plus 1e-6; dr_grpo, minus the group's mean; rloo, minus the mean of the group's other rewards (0
    alone in its group). A group whose rewards are all equal gets exactly 0 (its mean, a sum over a count, can differ
    from its rewards in the last bit)."""
    advantages = torch.zeros_like(rewards)
    for group in groups.unique():
        members = groups == group
        values = rewards[members]
        if values.unique().numel() == 1:
            continue
        centred = values - values.mean()
        if estimator is AdvantageEstimator.GRPO:
            advantages[members] = centred / (values.std(unbiased=False) + 1e-6)
        elif estimator is AdvantageEstimator.DR_GRPO:
            advantages[members] = centred
        elif len(values) > 1:  # r_i - mean of the others = n / (n - 1) (r_i - mean)
            advantages[members] = centred * len(values) / (len(values) - 1)
    return advantages


def whitened_rewards(rewards: torch.Tensor, tokens: torch.Tensor, device: torch.device) -> torch.Tensor:
    """REINFORCE++'s advantages: each reward (every token's return, with one reward at the end and no discount)
    whitened over every token of the step on every rank, as verl's masked_whiten: (r - mean) / sqrt(var + 1e-8),
    mean and unbiased variance over the tokens (``tokens``: each sequence's count; two collectives). The variance is
    taken in two passes, the squares of the rewards' distances to the mean: one pass (the mean of the squares minus
    the square of the mean) loses every digit of a small spread around a large reward."""
    count, total = _summed([tokens.sum().item(), (tokens * rewards).sum().item()], device)
    mean = total / max(count, 1.0)
    (squares,) = _summed([(tokens * (rewards - mean) ** 2).sum().item()], device)
    variance = squares / (count - 1) if count > 1 else 0.0
    return (rewards - mean) / math.sqrt(variance + 1e-8)


def _batch_statistics(
    rewards: torch.Tensor, advantages: torch.Tensor, groups: torch.Tensor, sampled: torch.Tensor, kept: torch.Tensor
) -> Statistics:
    """The rewards, the groups whose advantages are all 0 (no gradient: under grpo, dr_grpo and rloo a group whose
    rewards are all equal; under reinforce_plus_plus, which has no group baseline, only one whose rewards are all
    the step's mean) and the sampled tokens the trainer's top-p set leaves out."""
    equal = sum(int(bool((advantages[groups == group] == 0).all())) for group in groups.unique())
    return Statistics(
        {
            "samples": float(len(rewards)),
            "reward": rewards.sum().item(),
            "groups": float(groups.unique().numel()),
            "zero_advantage_groups": float(equal),
            "sampled_tokens": sampled.sum().item(),
            "outside_top_p": (sampled - kept).sum().item(),
        }
    )


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _gradient_statistics(norm: float, taken: bool) -> Statistics:
    """An optimiser step's gradient norm (before clipping), or a step skipped (``taken`` False) for a norm that is
    not finite, which no metric averages in. The norm is the whole model's, the same on every rank, so rank 0's
    alone is counted (every rank has the statistics, which ``across_ranks`` adds)."""
    counted = 1.0 if not dist.is_initialized() or dist.get_rank() == 0 else 0.0
    if not taken:
        return Statistics({"optimizer_steps": 0.0, "skipped_optimizer_steps": counted})
    return Statistics({"grad_norm": norm * counted, "optimizer_steps": counted, "skipped_optimizer_steps": 0.0})


def _summed(values: list[float], device: torch.device, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> list[float]:
    """``values`` reduced over the ranks (as they are without a process group)."""
    if not dist.is_initialized():
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=op)
    return [float(value) for value in tensor.tolist()]


def micro_batches(
    rows: Sequence[int], rollouts: Sequence[Rollout], tokens: int | None, device: torch.device
) -> list[list[int]]:
    """``rows`` in consecutive micro-batches of about ``tokens`` padded tokens each, as many on every rank (each
    forward and backward of a sharded model is a collective): the most any rank needs, but no more than the fewest
    rows any rank has."""
    longest = max(len(rollouts[i].prompt) + len(rollouts[i].completion) for i in rows)
    wanted = 1 if tokens is None else math.ceil(len(rows) * longest / tokens)
    most, fewest = _summed([wanted, -len(rows)], device, dist.ReduceOp.MAX)
    count = max(1, min(int(most), -int(fewest)))
    return [chunk.tolist() for chunk in torch.tensor_split(torch.tensor(list(rows)), count)]


def learn(
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    rollouts: Sequence[Rollout],
    rewards: Sequence[float],
    objective: Objective,
    temperature: float,
    *,
    top_p: float = 1.0,
    version: int | None = None,
    max_lag: int | None = None,
    max_tokens: int | None = None,
    reference: Policy | None = None,
    replay_routing: bool = False,
    skipped: SkippedSteps | None = None,
) -> dict[str, float]:
    """``objective.minibatches`` optimiser steps on a batch of rollouts (each on a slice of its prompt groups, in
    micro-batches of ``objective.tokens_per_micro_batch``); this rank's metrics (its sums and counts over the
    micro-batches and minibatches, divided once) and those statistics, which ``across_ranks`` combines.
    ``max_tokens`` (spec.trainer.rollout.maxTokens) is seq-mean-token-sum-norm's constant. ``reference``: the frozen
    policy of a KL term (objective.kl_coefficient) in full fine-tuning; None: the policy's LoRA adapter disabled.

    The ratios are taken against the model as it was when the batch arrived (``old``), so they depart from 1, and
    clipping acts, from the second minibatch on; the entropy is that model's. ``version`` is the weights version the
    model holds: tokens sampled under it give the on-policy mismatch (``onpolicy_mean_abs_logprob_diff``, pure
    numerics) and the others the ``staleness``. On several ranks every rank calls it, with its own prompt groups and
    as many of them.

    The staleness bound: with ``version`` and ``max_lag``, a rollout with a token more than ``max_lag`` versions
    behind ``version`` never reaches the loss; it raises ValueError (the trainer drops such samples before,
    lockstep_workers.rollout.producer).

    An MoE model (lockstep_workers.trainer.routing): with ``replay_routing`` every pass of the policy computes each
    token with the experts of its rollout's engine routing (``Rollout.routed_experts``, where present); the first pass
    measures the routing (routing_mismatch against the engine's, expert_load_imbalance), and with
    objective.router_aux_loss_coefficient the loss adds the routers' load-balancing loss. Never otherwise: the
    model's own forward, which adds it with output_router_logits, is not what computes the loss here.

    An optimiser step whose gradient norm is not finite is skipped: its gradients are dropped and no weight changes
    (metric ``skipped_optimizer_steps``, and a warning). ``skipped`` counts them in a row across calls (the trainer's
    own; None: this call's alone) and raises NonFiniteGradients at its limit.
    """
    if version is not None and max_lag is not None:
        stale = [lag_of(r, version) for r in rollouts if lag_of(r, version) > max_lag]
        if stale:
            raise ValueError(
                f"{len(stale)} rollout(s) up to {max(stale)} versions behind weights version {version}, more than "
                f"spec.trainer.maxLag {max_lag}: they must be dropped before learning"
            )
    skipped = skipped if skipped is not None else SkippedSteps()
    device = device_of(policy)
    everything = list(range(len(rollouts)))
    widest = max(len(r.completion) for r in rollouts)
    moe = routing.routers(policy.causal_lm)
    if moe:  # the engine's routings over the MoE layers, however vLLM lays them out
        rollouts = [
            r
            if r.routed_experts is None
            else replace(r, routed_experts=routing.over_moe_layers(r.routed_experts, policy.causal_lm))
            for r in rollouts
        ]
    aux_coefficient = objective.router_aux_loss_coefficient if moe else 0.0
    passes = []
    routed: dict[str, float] = {}
    for rows in micro_batches(everything, rollouts, objective.tokens_per_micro_batch, device):
        scored = [rollouts[i] for i in rows]
        with torch.no_grad(), _routed(moe, scored, replay_routing, device, measured=routed):
            passes.append(token_logprobs(policy, scored, temperature, top_p=top_p, with_entropy=True, width=widest))
    old, entropy, completion = (torch.cat([part[n] for part in passes]) for n in range(3))  # type: ignore[misc]
    references = _reference_logprobs(reference, policy, rollouts, objective, temperature, top_p, widest, device)
    # Only the tokens the policy sampled reach the loss, not those a multi-turn environment inserted; a token vLLM
    # sampled that falls outside the trainer's top-p set has no finite ratio: it is left out too.
    sampled = completion.clone()
    for row, r in enumerate(rollouts):
        if r.policy_mask:
            sampled[row, : len(r.policy_mask)] *= torch.tensor(r.policy_mask, dtype=sampled.dtype, device=device)
    mask = sampled * old.isfinite()
    old = old.nan_to_num(neginf=0.0)
    rollout = torch.zeros_like(old)
    for row, r in enumerate(rollouts):
        rollout[row, : len(r.logprobs)] = torch.tensor(r.logprobs)
    reward = torch.tensor(list(rewards), dtype=torch.float64)
    groups = torch.tensor([r.group for r in rollouts])
    if objective.advantage is AdvantageEstimator.REINFORCE_PLUS_PLUS:
        advantages = whitened_rewards(reward, mask.sum(dim=-1).double().cpu(), device).to(device)
    else:
        advantages = group_advantages(reward, groups, objective.advantage).to(device)
    statistics = _batch_statistics(reward, advantages.cpu(), groups, sampled.cpu(), mask.cpu()) + Statistics(routed)
    for chunk in torch.tensor_split(groups.unique(), objective.minibatches):
        rows = torch.isin(groups, chunk).nonzero()[:, 0].tolist()
        # What the minibatch's loss averages over, on every rank together: each micro-batch's loss is weighted by
        # its share of the total, times the ranks, since FSDP averages the gradients over them.
        (total, sequences) = _summed([loss_denominator(mask[rows], objective), float(len(rows))], device)
        optimizer.zero_grad()
        for part in micro_batches(rows, rollouts, objective.tokens_per_micro_batch, device):
            batched = [rollouts[i] for i in part]
            # The backward runs within too: a layer recomputed in it (activation checkpointing) routes alike.
            with _routed(moe, batched, replay_routing, device, keep_logits=bool(aux_coefficient)) as record:
                new, new_entropy, _ = token_logprobs(
                    policy,
                    batched,
                    temperature,
                    top_p=top_p,
                    with_entropy=bool(objective.entropy_coefficient),
                    width=widest,
                )
                kept = mask[part]
                batch = Batch(
                    torch.where(kept.bool(), new, 0.0),
                    old[part],
                    rollout[part],
                    advantages[part],
                    kept,
                    entropy[part],
                    None if new_entropy is None else torch.where(kept.bool(), new_entropy, 0.0),
                    None if references is None else references[part],
                )
                loss, measured = policy_loss(batch, objective, max_tokens)
                loss = loss * measured.sums["loss_units"] / max(total, 1.0)
                if aux_coefficient:  # the minibatch's mean over its sequences, as the loss's share is
                    aux = routing.aux_loss(moe, record, attention_mask(batched).to(device))
                    loss = loss + aux_coefficient * aux * len(part) / sequences
                    measured += Statistics(routing.aux_statistics(aux.item(), len(part)))
                (loss * _world()).backward()
            statistics += measured
        norm = clip_gradients(policy.parameters(), objective.optimizer.max_grad_norm)
        if skipped.allows(norm):
            optimizer.step()
            statistics += _gradient_statistics(norm, taken=True)
        else:
            optimizer.zero_grad()
            statistics += _gradient_statistics(norm, taken=False)
    if version is not None:
        statistics += _staleness(rollouts, old, rollout, mask, version)
    return {**statistics.metrics(), **statistics.as_floats()}


def _reference_logprobs(
    reference: Policy | None,
    policy: Policy,
    rollouts: Sequence[Rollout],
    objective: Objective,
    temperature: float,
    top_p: float,
    width: int,
    device: torch.device,
) -> torch.Tensor | None:
    """With a KL coefficient, the reference policy's logprobs of the completions ([sequences, ``width``], no
    gradient, 0 where outside its top-p set): ``reference``'s, a frozen copy of the base model, or without one the
    policy's with its LoRA adapter disabled (lockstep_workers.weights.lora.base_only), through the same head as the
    policy's; None without a KL coefficient."""
    if not objective.kl_coefficient:
        return None
    everything = list(range(len(rollouts)))
    scorer = reference if reference is not None else policy
    with torch.no_grad(), contextlib.nullcontext() if reference is not None else lora.base_only(policy.causal_lm):
        parts = [
            token_logprobs(scorer, [rollouts[i] for i in rows], temperature, top_p=top_p, width=width)[0]
            for rows in micro_batches(everything, rollouts, objective.tokens_per_micro_batch, device)
        ]
    return torch.cat(parts).nan_to_num(neginf=0.0)


def _staleness(
    rollouts: Sequence[Rollout], old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, version: int
) -> Statistics:
    """Mismatch on the tokens of sequences sampled wholly under ``version`` (numerics alone: a sequence that spans
    an in-flight update keeps KV computed under the old weights); how many versions behind the oldest token was
    (``staleness``, not to be confused with the job's status.lag, which is how far the actors are behind)."""
    versions = torch.full_like(mask, float(version))
    for row, r in enumerate(rollouts):
        versions[row, : len(r.versions)] = torch.tensor(r.versions, dtype=versions.dtype)
    seen = versions.masked_fill(~mask.bool(), float(version))
    onpolicy = mask * (seen == version).all(dim=1, keepdim=True).float()
    spanning = (seen.amax(dim=1) != seen.amin(dim=1)).float()
    return Statistics(
        {
            "onpolicy_abs_logprob_diff": ((old - rollout).abs() * onpolicy).sum().item(),
            "onpolicy_tokens": onpolicy.sum().item(),
            "spanning": spanning.sum().item(),
        },
        {"staleness": version - seen.min().item()},
    )


def across_ranks(metrics: dict[str, float], device: torch.device) -> dict[str, float]:
    """The metrics of every rank's ``learn`` together (a collective, on ``device``): their statistics added (the
    maxima the largest) over the ranks, then divided once, as on one rank with the whole batch."""
    statistics = Statistics.from_floats(metrics)
    sums, maxima = sorted(statistics.sums), sorted(statistics.maxima)
    added = _summed([statistics.sums[n] for n in sums], device)
    largest = _summed([statistics.maxima[n] for n in maxima], device, dist.ReduceOp.MAX) if maxima else []
    return Statistics(dict(zip(sums, added, strict=True)), dict(zip(maxima, largest, strict=True))).metrics()
