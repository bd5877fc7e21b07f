"""Routing in the trainer's MoE layers (lockstep_workers.trainer.routing), on the tiny random model of each MoE family
of tiny_models, one for each router of its table: replaying the model's own routing changes nothing; replaying another
routing computes what a hand-written MoE layer forced to it computes, with the gradient reaching the router; the
metrics count what they say; ``learn`` replays the samples' engine routings, measures them and adds the aux loss
only when asked; a dense model has no routing metric."""

from __future__ import annotations

from collections.abc import Callable
from copy import deepcopy
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from lockstep.api import Objective
from lockstep_workers.rollout.record import Rollout
from lockstep_workers.tiny_models import FAMILIES, Family, create_tiny_model
from lockstep_workers.trainer import routing
from lockstep_workers.trainer.learner import Policy, learn
from lockstep_workers.trainer.routing import EXPERT_LOAD_IMBALANCE, ROUTING_MISMATCH, TOKENS_DROPPED

MOE_FAMILIES = [f for f in FAMILIES if f.mixture_of_experts]


@pytest.fixture(scope="module", params=MOE_FAMILIES, ids=lambda f: f.name)
def model(request: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoModelForCausalLM

    family: Family = request.param
    path = create_tiny_model(family, tmp_path_factory.mktemp(family.name))
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


IDS = torch.randint(0, 256, (3, 12), generator=torch.Generator().manual_seed(0))


def logits_of(model: Any, ids: torch.Tensor = IDS) -> torch.Tensor:
    return model(input_ids=ids).logits


def own_routing(model: Any, ids: torch.Tensor = IDS) -> torch.Tensor:
    """The model's own top-k of every token of ``ids``, flattened: [tokens, MoE layers, top_k]."""
    moe = routing.routers(model)
    with torch.no_grad(), routing.routed(moe) as record:
        model(input_ids=ids)
    return torch.stack([record.own[layer] for layer in range(len(moe))], dim=1)


def perturbed(own: torch.Tensor, experts: int, every: int = 3) -> torch.Tensor:
    """``own`` with every ``every``th (token, layer) pair's first expert swapped for one outside its top-k: that
    pair's set differs."""
    changed = own.clone()
    for pair, (token, layer) in enumerate(torch.cartesian_prod(torch.arange(len(own)), torch.arange(own.shape[1]))):
        if pair % every == 0:
            chosen = set(own[token, layer].tolist())
            changed[token, layer, 0] = next(e for e in range(experts) if e not in chosen)
    return changed


def test_every_router_of_the_table_has_a_family_and_every_moe_family_a_router(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    found = set()
    for family in MOE_FAMILIES:
        causal_lm = AutoModelForCausalLM.from_pretrained(create_tiny_model(family, tmp_path / family.name))
        names = {type(router).__name__ for router in routing.routers(causal_lm)}
        assert len(names) == 1, f"{family.name}: its routers are not in routing.ROUTERS"
        found |= names
    assert found == set(routing.ROUTERS)


def test_replaying_the_models_own_routing_changes_nothing(model: Any) -> None:
    moe = routing.routers(model)
    assert len(moe) == 2
    with torch.no_grad():
        plain = logits_of(model)
        own = own_routing(model)
        with routing.routed(moe, own, replay=True):
            replayed = logits_of(model)
    torch.testing.assert_close(replayed, plain, rtol=0, atol=1e-6)


def moe_block_by_hand(block: Any, hidden: torch.Tensor, chosen: torch.Tensor, renormalize: bool) -> torch.Tensor:
    """The MoE block's output ([tokens, hidden]) with each token forced to the experts ``chosen`` ([tokens, top_k]),
    written out from the block's weights: the router's softmax probabilities of them (renormalized), each expert's
    SwiGLU, and a Qwen2-MoE block's gated shared expert."""
    probabilities = F.softmax(hidden @ block.gate.weight.T, dim=-1).gather(1, chosen)
    if renormalize:
        probabilities = probabilities / probabilities.sum(dim=-1, keepdim=True)
    experts = block.experts
    out = torch.zeros_like(hidden)
    for token in range(len(hidden)):
        for slot, expert in enumerate(chosen[token].tolist()):
            gate, up = (experts.gate_up_proj[expert] @ hidden[token]).chunk(2)
            out[token] += probabilities[token, slot] * (experts.down_proj[expert] @ (experts.act_fn(gate) * up))
    if hasattr(block, "shared_expert"):
        out += torch.sigmoid(block.shared_expert_gate(hidden)) * block.shared_expert(hidden)
    return out


def test_a_replayed_routing_computes_what_a_layer_forced_to_it_computes(model: Any) -> None:
    moe = routing.routers(model)
    experts = moe[0].num_experts
    own = own_routing(model)
    forced = perturbed(own, experts)
    block = model.model.layers[1].mlp
    seen: dict[str, torch.Tensor] = {}
    hook = block.register_forward_hook(lambda _, inputs, output: seen.update(input=inputs[0], output=output))
    try:
        with torch.no_grad():
            plain = logits_of(model)
            with routing.routed(moe, forced, replay=True) as record:
                replayed = logits_of(model)
    finally:
        hook.remove()
    hidden = seen["input"].flatten(0, 1)
    renormalize = routing.ROUTERS[type(moe[1]).__name__](moe[1])
    with torch.no_grad():
        expected = moe_block_by_hand(block, hidden, forced[:, 1], renormalize)
    torch.testing.assert_close(seen["output"].flatten(0, 1), expected, rtol=1e-5, atol=1e-7)  # outputs ~1e-2
    assert torch.equal(record.used[1], forced[:, 1])
    assert (replayed - plain).abs().max() > 1e-3  # another routing, other logits


def test_the_gradient_reaches_the_router_under_replay(model: Any) -> None:
    moe = routing.routers(model)
    forced = perturbed(own_routing(model), moe[0].num_experts)
    model.zero_grad()
    with routing.routed(moe, forced, replay=True):
        logits_of(model).logsumexp(dim=-1).sum().backward()
    for router in moe:
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    model.zero_grad()


def test_the_mismatch_is_0_for_the_own_routing_and_the_perturbed_fraction_otherwise(model: Any) -> None:
    moe = routing.routers(model)
    own = own_routing(model)
    counted = torch.ones(len(own), dtype=torch.bool)
    pairs = own.shape[0] * own.shape[1]
    changed = perturbed(own, moe[0].num_experts, every=3)
    # Replayed, a perturbed routing changes the later layers' inputs, and so their own choices: not that case.
    for engine, replay, expected in ((own, False, 0), (own, True, 0), (changed, False, (pairs + 2) // 3)):
        with torch.no_grad(), routing.routed(moe, engine, replay=replay) as record:
            logits_of(model)
        metrics = routing.routing_metrics(routing.routing_statistics(moe, record, counted, engine))
        assert metrics[ROUTING_MISMATCH] == pytest.approx(expected / pairs)
        assert 1 <= metrics[EXPERT_LOAD_IMBALANCE] <= moe[0].num_experts


def test_only_the_tokens_with_an_engine_routing_are_compared_and_replayed(model: Any) -> None:
    """A batch of two sequences, the second's routing missing and the first's one row short (vLLM's): those
    tokens keep their own routing and stay out of the mismatch."""
    moe = routing.routers(model)
    ids = IDS[:2]
    own = own_routing(model, ids).unflatten(0, (2, -1))
    first = perturbed(own[0], moe[0].num_experts, every=2)[:-1]
    engine = routing.engine_routing([first, None], ids.shape[1])
    assert engine is not None
    with torch.no_grad(), routing.routed(moe, engine, replay=True) as record:
        logits_of(model, ids)
    assert torch.equal(record.used[0][: len(first)], first[:, 0])
    assert torch.equal(record.used[0][len(first) :], own.flatten(0, 1)[len(first) :, 0])
    with torch.no_grad(), routing.routed(moe, engine) as record:  # not replayed: each layer's own is the plain one
        logits_of(model, ids)
    statistics = routing.routing_statistics(moe, record, torch.ones(engine.shape[0], dtype=torch.bool), engine)
    compared = len(first) * len(moe)
    assert routing.routing_metrics(statistics)[ROUTING_MISMATCH] == pytest.approx((compared + 1) // 2 / compared)


def test_without_engine_routings_the_mismatch_and_tokens_dropped_are_null_never_0(model: Any) -> None:
    moe = routing.routers(model)
    with torch.no_grad(), routing.routed(moe) as record:
        logits_of(model)
    counted = torch.ones(IDS.numel(), dtype=torch.bool)
    metrics = routing.routing_metrics(routing.routing_statistics(moe, record, counted, None))
    assert ROUTING_MISMATCH not in metrics
    assert routing.unmeasured(metrics) == {ROUTING_MISMATCH: None, TOKENS_DROPPED: None}


def test_the_load_imbalance_is_the_busiest_experts_tokens_over_the_mean() -> None:
    sums = {
        **{f"routing_load/0/{e}": t for e, t in enumerate([4.0, 2.0, 1.0, 1.0])},  # max 4 over mean 2: 2
        **{f"routing_load/1/{e}": 2.0 for e in range(4)},  # even: 1
    }
    assert routing.routing_metrics(sums) == {EXPERT_LOAD_IMBALANCE: 1.5}
    assert routing.routing_metrics({}) == {}
    assert routing.unmeasured({}) == {}  # a dense model's step: no routing metric at all


def test_the_aux_loss_is_the_familys_own(model: Any) -> None:
    """The loss of the logits the replay context kept is the one the model's own forward adds with
    output_router_logits."""
    moe = routing.routers(model)
    attention = torch.ones_like(IDS)
    attention[1, 8:] = 0
    with torch.no_grad(), routing.routed(moe, keep_logits=True) as record:
        own = model(input_ids=IDS, attention_mask=attention, output_router_logits=True)
    torch.testing.assert_close(routing.aux_loss(moe, record, attention), own.aux_loss)


def test_a_routing_of_another_model_is_refused(model: Any) -> None:
    moe = routing.routers(model)
    wrong = torch.zeros(IDS.numel(), len(moe) + 1, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="MoE layers"), routing.routed(moe, wrong, replay=True):
        pass


def rollouts_with_routing(model: Any, routed: Callable[[torch.Tensor], torch.Tensor | None]) -> list[Rollout]:
    """Two groups of two completions of random prompts, with the logprobs of the model and, as an engine returns them
    (prompt + completion - 1 rows), ``routed`` of the model's own routing of each sequence (an MoE model's)."""
    rollouts = []
    for row, sequence in enumerate(torch.randint(0, 256, (4, 10), generator=torch.Generator().manual_seed(1)).tolist()):
        prompt, completion = sequence[:5], sequence[5 : 6 + row]
        rollout = Rollout(prompt, completion, [-1.0] * len(completion), row // 2, [0] * len(completion))
        if routing.routers(model):
            own = own_routing(model, torch.tensor([prompt + completion]))[:-1]
            rollout = replace(rollout, routed_experts=routed(own))
        rollouts.append(rollout)
    return rollouts


def learned(
    model: Any, rollouts: list[Rollout], replay: bool, aux: float = 0.0, checkpointing: bool = False
) -> dict[str, float]:
    """The metrics of one ``learn`` on a copy of ``model`` (the routers' gradient norm as ``router_grad_norm``),
    with ``checkpointing`` each layer recomputed in the backward pass."""
    trained = deepcopy(model).train()
    if checkpointing:
        trained.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    objective = Objective(minibatches=1, router_aux_loss_coefficient=aux, learning_rate=1e-3)
    optimizer = torch.optim.SGD(trained.parameters(), lr=0.0)
    policy = Policy(trained)
    metrics = learn(policy, optimizer, rollouts, [0.0, 1.0, 0.5, 0.0], objective, 1.0, version=0, replay_routing=replay)
    grads = [router.weight.grad for router in routing.routers(trained)]
    return {**metrics, "router_grad_norm": float(torch.stack([g.norm() for g in grads if g is not None]).norm())}


def test_learn_replays_the_engines_routing_and_measures_its_mismatch(model: Any) -> None:
    experts = routing.routers(model)[0].num_experts
    own = learned(model, rollouts_with_routing(model, lambda r: r), replay=True)
    assert own[ROUTING_MISMATCH] == 0.0
    assert 1 <= own[EXPERT_LOAD_IMBALANCE] <= experts
    unreplayed = learned(model, rollouts_with_routing(model, lambda r: r), replay=False)
    assert unreplayed["loss"] == own["loss"]  # the own routing replayed: nothing changes
    other = rollouts_with_routing(model, lambda r: perturbed(r, experts, every=2))
    replayed, measured = learned(model, other, replay=True), learned(model, other, replay=False)
    assert measured[ROUTING_MISMATCH] == pytest.approx(
        sum((len(r.routed_experts) * 2 + 1) // 2 for r in other if r.routed_experts is not None)
        / sum(len(r.routed_experts) * 2 for r in other if r.routed_experts is not None)
    )
    assert measured["loss"] == unreplayed["loss"]  # not replayed: the engine's routing is only measured
    assert replayed["loss"] != measured["loss"] and replayed["router_grad_norm"] > 0
    none = learned(model, rollouts_with_routing(model, lambda r: None), replay=True)
    assert ROUTING_MISMATCH not in none and none["loss"] == unreplayed["loss"]
    assert routing.ROUTER_AUX_LOSS not in own


def test_a_layer_recomputed_in_the_backward_pass_is_replayed_too(model: Any) -> None:
    other = rollouts_with_routing(model, lambda r: perturbed(r, routing.routers(model)[0].num_experts, every=2))
    plain, recomputed = learned(model, other, replay=True), learned(model, other, replay=True, checkpointing=True)
    assert recomputed["router_grad_norm"] == pytest.approx(plain["router_grad_norm"], rel=1e-6)
    assert recomputed["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-6)


def test_the_router_aux_loss_is_added_only_when_asked(model: Any) -> None:
    rollouts = rollouts_with_routing(model, lambda r: None)
    off, on = learned(model, rollouts, replay=False), learned(model, rollouts, replay=False, aux=0.5)
    assert routing.ROUTER_AUX_LOSS not in off
    assert on[routing.ROUTER_AUX_LOSS] >= 1.0 - 1e-6  # Switch's loss is at least 1: equal loads and probabilities
    assert on["router_grad_norm"] != off["router_grad_norm"]
    assert on["loss"] == off["loss"]  # the policy loss alone; the term is its own metric


def test_a_dense_model_has_no_routing_metrics(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from lockstep_workers.tiny_models import family

    dense = AutoModelForCausalLM.from_pretrained(create_tiny_model(family("llama"), tmp_path), dtype=torch.float32)
    assert routing.routers(dense) == []
    metrics = learn(
        Policy(dense),
        torch.optim.SGD(dense.parameters(), lr=0.0),
        rollouts_with_routing(dense, lambda r: None),
        [0.0, 1.0, 0.5, 0.0],
        Objective(minibatches=1, router_aux_loss_coefficient=0.5),
        1.0,
        replay_routing=True,
    )
    assert not {ROUTING_MISMATCH, EXPERT_LOAD_IMBALANCE, TOKENS_DROPPED, routing.ROUTER_AUX_LOSS} & set(metrics)
    assert not any(name.startswith("routing") for name in metrics)
