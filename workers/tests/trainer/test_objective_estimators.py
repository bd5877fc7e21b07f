"""Advantage estimators, loss aggregations and the entropy bonus (spec.trainer.objective.advantage,
lossAggregation, entropyCoefficient) against float64 references written from the papers' and peers' formulas (verl's
core_algos.agg_loss and advantage estimators, TRL's GRPO loss types, Dr. GRPO, GSPO): loss and gradient to 1e-6 on
random batches; the defaults keep today's losses exactly."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lockstep.api import AdvantageEstimator, Algorithm, KlEstimator, LossAggregation, Objective, RolloutCorrection
from lockstep_workers.trainer.learner import group_advantages, whitened_rewards
from lockstep_workers.trainer.objective import Batch, policy_loss

MAX_TOKENS = 7
LOW, HIGH = 0.8, 1.28


def random_batch(seed: int, sequences: int) -> tuple[torch.Tensor, ...]:
    """new, old, advantages, mask, entropy (float64); ragged lengths, one sequence possibly empty."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, MAX_TOKENS + 1, (sequences,), generator=generator)
    lengths[0] = max(int(lengths[0]), 1)
    mask = (torch.arange(MAX_TOKENS)[None, :] < lengths[:, None]).double()
    old = -torch.rand(sequences, MAX_TOKENS, generator=generator, dtype=torch.float64) * 3
    new = old + torch.randn(sequences, MAX_TOKENS, generator=generator, dtype=torch.float64) * 0.3
    advantages = torch.randn(sequences, generator=generator, dtype=torch.float64)
    entropy = torch.rand(sequences, MAX_TOKENS, generator=generator, dtype=torch.float64) * 2
    return new * mask, old * mask, advantages, mask, entropy * mask


def reference_loss(
    new: torch.Tensor,
    old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    entropy: torch.Tensor,
    algorithm: Algorithm,
    aggregation: LossAggregation,
    coefficient: float,
    reference: torch.Tensor,
    kl: tuple[float, KlEstimator],
    dual_clip: float | None = None,
) -> torch.Tensor:
    """-agg(min(r A, clip(r) A)) - c agg(H) + beta agg(k(log pi - log pi_ref)), term by term: r per token (PPO,
    GRPO) or GSPO's s_i = exp(mean_t log r) for every token of sequence i; agg as verl's agg_loss (token-mean;
    seq-mean-token-mean) and TRL's dr_grpo (sum over the batch's tokens / (sequences x max completion length));
    with ``dual_clip`` c, verl's vanilla loss: a term with A < 0 is max(term, c A)."""
    per_sequence_terms: list[list[torch.Tensor]] = []
    per_sequence_entropy: list[list[torch.Tensor]] = []
    per_sequence_kl: list[list[torch.Tensor]] = []
    beta, estimator = kl
    for i in range(len(mask)):
        kept = [t for t in range(mask.shape[1]) if mask[i, t]]
        if not kept:
            continue
        if algorithm is Algorithm.GSPO:
            s = torch.exp(sum(new[i, t] - old[i, t] for t in kept) / len(kept))
            ratios = [s] * len(kept)
        else:
            ratios = [torch.exp(new[i, t] - old[i, t]) for t in kept]
        a = advantages[i]
        terms = [torch.minimum(r * a, r.clamp(LOW, HIGH) * a) for r in ratios]
        if dual_clip is not None and a < 0:
            terms = [torch.maximum(term, dual_clip * a) for term in terms]
        per_sequence_terms.append(terms)
        per_sequence_entropy.append([entropy[i, t] for t in kept])
        per_sequence_kl.append([schulman(new[i, t] - reference[i, t], estimator) for t in kept])

    def agg(values: list[list[torch.Tensor]]) -> torch.Tensor:
        if aggregation is LossAggregation.TOKEN_MEAN:
            return sum(sum(v) for v in values) / sum(len(v) for v in values)
        if aggregation is LossAggregation.SEQ_MEAN_TOKEN_MEAN:
            return sum(sum(v) / len(v) for v in values) / len(values)
        return sum(sum(v) for v in values) / (len(values) * MAX_TOKENS)

    return -agg(per_sequence_terms) - coefficient * agg(per_sequence_entropy) + beta * agg(per_sequence_kl)


def schulman(x: torch.Tensor, estimator: KlEstimator) -> torch.Tensor:
    """k1 = log(p/q), k2 = log(p/q)^2 / 2, k3 = q/p - 1 - log(q/p), at a token sampled from p (well inside verl's
    clamps here)."""
    if estimator is KlEstimator.K1:
        return x
    if estimator is KlEstimator.K2:
        return x**2 / 2
    return torch.exp(-x) - 1 + x


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    sequences=st.integers(1, 6),
    algorithm=st.sampled_from(list(Algorithm)),
    aggregation=st.sampled_from(list(LossAggregation)),
    coefficient=st.sampled_from([0.0, 0.05]),
    kl=st.sampled_from([(0.0, KlEstimator.K3), *((0.1, estimator) for estimator in KlEstimator)]),
    dual_clip=st.sampled_from([None, 1.1]),  # just above 1: ratios of this batch's spread reach it
)
def test_the_loss_and_its_gradient_are_the_formulas(
    seed: int,
    sequences: int,
    algorithm: Algorithm,
    aggregation: LossAggregation,
    coefficient: float,
    kl: tuple[float, KlEstimator],
    dual_clip: float | None,
) -> None:
    new, old, advantages, mask, entropy = random_batch(seed, sequences)
    reference = (
        old + torch.randn(old.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 0.2
    ) * mask
    objective = Objective(
        algorithm=algorithm,
        loss_aggregation=aggregation,
        entropy_coefficient=coefficient,
        kl_coefficient=kl[0],
        kl_estimator=kl[1],
        clip_epsilon_low=1 - LOW,
        clip_epsilon_high=HIGH - 1,
        dual_clip_ratio=dual_clip,
        rollout_correction=RolloutCorrection(enabled=False),
    )
    ours_new, ours_entropy = new.clone().requires_grad_(True), entropy.clone().requires_grad_(True)
    batch = Batch(ours_new, old, old, advantages, mask, entropy, ours_entropy if coefficient else None, reference)
    loss, statistics = policy_loss(batch, objective, MAX_TOKENS)
    loss.backward()
    theirs_new, theirs_entropy = new.clone().requires_grad_(True), entropy.clone().requires_grad_(True)
    expected = reference_loss(
        theirs_new, old, advantages, mask, theirs_entropy, algorithm, aggregation, coefficient, reference, kl, dual_clip
    )
    expected.backward()
    assert abs(loss.item() - expected.item()) < 1e-6
    assert ours_new.grad is not None and theirs_new.grad is not None
    torch.testing.assert_close(ours_new.grad, theirs_new.grad, rtol=0, atol=1e-6)
    if coefficient:
        assert ours_entropy.grad is not None and theirs_entropy.grad is not None
        torch.testing.assert_close(ours_entropy.grad, theirs_entropy.grad, rtol=0, atol=1e-6)
        assert statistics.metrics()["entropy_bonus"] > 0
    if kl[0]:
        measured = statistics.metrics()
        tokens = [(i, t) for i in range(len(mask)) for t in range(MAX_TOKENS) if mask[i, t]]
        estimates = [schulman(new[i, t] - reference[i, t], kl[1]).item() for i, t in tokens]
        assert abs(measured["kl_ref"] - sum(estimates) / len(estimates)) < 1e-9
        assert "kl_loss" in measured
    assert statistics.metrics()["loss"] == loss.item() or abs(statistics.metrics()["loss"] - loss.item()) < 1e-9


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), algorithm=st.sampled_from([Algorithm.PPO, Algorithm.GRPO, Algorithm.GSPO]))
def test_an_algorithm_without_an_aggregation_keeps_its_own_exactly(seed: int, algorithm: Algorithm) -> None:
    """ppo is token-mean, grpo and gspo seq-mean-token-mean: bit for bit, value and gradient."""
    new, old, advantages, mask, entropy = random_batch(seed, 5)
    own = {Algorithm.PPO: LossAggregation.TOKEN_MEAN}.get(algorithm, LossAggregation.SEQ_MEAN_TOKEN_MEAN)
    found = []
    for aggregation in (None, own):
        leaf = new.clone().requires_grad_(True)
        batch = Batch(leaf, old, old - 0.1, advantages, mask, entropy)
        loss, _ = policy_loss(batch, Objective(algorithm=algorithm, loss_aggregation=aggregation))
        loss.backward()
        found.append((loss.detach(), leaf.grad))
    assert torch.equal(found[0][0], found[1][0]) and torch.equal(found[0][1], found[1][1])


def reference_advantages(rewards: list[float], groups: list[int], estimator: AdvantageEstimator) -> list[float]:
    """GRPO: (r - mean) / (population std + 1e-6); Dr. GRPO: r - mean; RLOO: r - the mean of the group's others."""
    out = []
    for reward, group in zip(rewards, groups, strict=True):
        mine = [r for r, g in zip(rewards, groups, strict=True) if g == group]
        mean = sum(mine) / len(mine)
        if estimator is AdvantageEstimator.GRPO:
            out.append((reward - mean) / (math.sqrt(sum((r - mean) ** 2 for r in mine) / len(mine)) + 1e-6))
        elif estimator is AdvantageEstimator.DR_GRPO:
            out.append(reward - mean)
        else:
            out.append(reward - (sum(mine) - reward) / (len(mine) - 1) if len(mine) > 1 else 0.0)
    return out


@settings(max_examples=40, deadline=None)
@given(
    rewards=st.lists(st.floats(-5, 5), min_size=1, max_size=12),
    groups=st.integers(1, 4),
    estimator=st.sampled_from([AdvantageEstimator.GRPO, AdvantageEstimator.DR_GRPO, AdvantageEstimator.RLOO]),
)
def test_group_advantages_are_the_estimators_formulas(
    rewards: list[float], groups: int, estimator: AdvantageEstimator
) -> None:
    membership = [n % groups for n in range(len(rewards))]
    found = group_advantages(torch.tensor(rewards, dtype=torch.float64), torch.tensor(membership), estimator)
    expected = reference_advantages(rewards, membership, estimator)
    torch.testing.assert_close(found, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-6)


@settings(max_examples=30, deadline=None)
@given(
    rewards=st.lists(st.floats(-5, 5), min_size=2, max_size=10),
    lengths=st.lists(st.integers(0, 6), min_size=10, max_size=10),
    offset=st.sampled_from([0.0, 1e5, -1e6]),
)
def test_reinforce_plus_plus_whitens_the_rewards_over_the_steps_tokens(
    rewards: list[float], lengths: list[int], offset: float
) -> None:
    """verl's masked_whiten of the returns: each token's return is its sequence's reward (one reward at the end,
    no discount); mean and unbiased variance over every token, also around a large reward (``offset``), against
    torch's own float64 variance of every token's return."""
    rewards = [offset + reward for reward in rewards]
    tokens = torch.tensor(lengths[: len(rewards)], dtype=torch.float64)
    values = torch.repeat_interleave(torch.tensor(rewards, dtype=torch.float64), tokens.long())
    found = whitened_rewards(torch.tensor(rewards, dtype=torch.float64), tokens, torch.device("cpu"))
    if len(values) < 2:
        return
    expected = (torch.tensor(rewards, dtype=torch.float64) - values.mean()) * torch.rsqrt(values.var() + 1e-8)
    torch.testing.assert_close(found, expected, rtol=1e-6, atol=1e-6)


def test_reinforce_plus_plus_keeps_a_small_spread_around_a_large_reward() -> None:
    """Issue 46 item 5: the one-pass variance (mean of squares minus square of the mean) gave [1e5, 1e5 + 1e-3]
    advantages of +-5.0; the exact ones, 100 tokens each, are +-0.978."""
    rewards = torch.tensor([1e5, 1e5 + 1e-3], dtype=torch.float64)
    found = whitened_rewards(rewards, torch.tensor([100.0, 100.0], dtype=torch.float64), torch.device("cpu"))
    spread = 5e-4 * math.sqrt(200 / 199)  # the unbiased standard deviation over the 200 tokens
    exact = 5e-4 / math.sqrt(spread**2 + 1e-8)
    assert found.tolist() == [pytest.approx(-exact, rel=1e-6), pytest.approx(exact, rel=1e-6)]
    assert abs(exact - 0.978) < 1e-3


def test_a_group_whose_rewards_are_all_equal_gets_exactly_no_advantage() -> None:
    """Their mean can differ from them in the last bit (three 0.1s average to 0.10000000000000002), which gave grpo
    advantages of 1e-11 where the API promises none."""
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.2, 0.3], dtype=torch.float64)
    for estimator in (AdvantageEstimator.GRPO, AdvantageEstimator.DR_GRPO, AdvantageEstimator.RLOO):
        found = group_advantages(rewards, torch.tensor([0, 0, 0, 1, 1]), estimator)
        assert found[:3].tolist() == [0.0, 0.0, 0.0], estimator
        assert found[3:].abs().min() > 0


def test_dual_clip_bounds_a_negative_advantages_term_at_c_times_it_with_no_gradient() -> None:
    """Issue 46 item 6: verl's dual-clip (clip_ratio_c, 3 in its vanilla loss): a ratio of 5 on a token with A = -1
    gives the term 3 A, not 5 A; a positive advantage, or a ratio within c, is the single clip's."""
    old = torch.zeros(3, 1, dtype=torch.float64)
    new = torch.tensor([[math.log(5.0)], [math.log(5.0)], [math.log(2.0)]], dtype=torch.float64, requires_grad=True)
    advantages = torch.tensor([-1.0, 1.0, -1.0], dtype=torch.float64)
    mask = torch.ones(3, 1, dtype=torch.float64)
    terms = {}
    for c in (None, 3.0):
        objective = Objective(
            algorithm=Algorithm.PPO, dual_clip_ratio=c, rollout_correction=RolloutCorrection(enabled=False)
        )
        loss, statistics = policy_loss(Batch(new, old, old, advantages, mask), objective)
        (gradient,) = torch.autograd.grad(loss, new)
        terms[c] = (-3 * loss.item(), gradient[:, 0].tolist(), statistics.metrics().get("pg_clipfrac_lower"))
    # single clip: -5 (A < 0, unclipped below), 1.28 (clipped above), -2
    assert terms[None][0] == pytest.approx(-5 + 1.28 - 2) and terms[None][2] is None
    assert terms[3.0][0] == pytest.approx(-3 + 1.28 - 2) and terms[3.0][2] == pytest.approx(1 / 3)
    assert terms[3.0][1][0] == 0.0 and terms[None][1][0] != 0.0, "the bounded term has no gradient"
    assert terms[3.0][1][1:] == terms[None][1][1:]
