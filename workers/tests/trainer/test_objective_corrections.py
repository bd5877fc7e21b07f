"""The rollout correction and the step's metrics against reference implementations written from the published
formulas (a loop over sequences, in float64), on random tensors with ragged lengths and masked tokens; and the
metrics' invariance: the same for any split of a batch into micro-batches and ranks."""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lockstep.api import Algorithm, CorrectionLevel, CorrectionMode, Objective, RolloutCorrection
from lockstep_workers.trainer.objective import Batch, Statistics, policy_loss

EPS_LOW, EPS_HIGH = 0.2, 0.28


def random_batch(seed: int, sequences: int = 6, width: int = 7, spread: float = 0.6, empty: bool = True) -> Batch:
    """Ragged lengths, a few masked tokens inside, ratios far from 1 both ways; with ``empty``, one sequence with no
    kept token (a rollout the environment wrote)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (sequences,), generator=generator)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).float()
    mask *= (torch.rand(sequences, width, generator=generator) > 0.15).float()
    mask[:, 0] = 1
    if empty:
        mask[sequences // 2] = 0
    old = -torch.rand(sequences, width, generator=generator) * 3
    rollout = old - spread * torch.randn(sequences, width, generator=generator)
    new = old + 0.4 * torch.randn(sequences, width, generator=generator)
    advantages = torch.randn(sequences, generator=generator)
    entropy = torch.rand(sequences, width, generator=generator)
    return Batch(new.requires_grad_(True), old, rollout, advantages, mask, entropy)


def rows_of(batch: Batch, rows: list[int]) -> Batch:
    """The batch's ``rows``, without the gradient's history."""
    assert batch.entropy is not None
    return Batch(
        *(t[rows].detach() for t in (batch.new, batch.old, batch.rollout, batch.advantages, batch.mask)),
        entropy=batch.entropy[rows],
    )


def objective(algorithm: str, **correction: Any) -> Objective:
    return Objective(
        algorithm=Algorithm(algorithm),
        clip_epsilon_low=EPS_LOW,
        clip_epsilon_high=EPS_HIGH,
        rollout_correction=RolloutCorrection(**correction),
    )


# -- the references -------------------------------------------------------------------------------------------------


def kept_of(batch: Batch, row: int) -> list[int]:
    return [t for t in range(batch.mask.shape[1]) if batch.mask[row, t] > 0]


def reference_weights(batch: Batch, row: int, correction: RolloutCorrection, algorithm: str) -> list[float]:
    """verl's rollout_correction (token, sequence, geometric; truncate or mask; veto), slime's TIS/MIS: one weight
    per kept token of ``row``."""
    tokens = kept_of(batch, row)
    rho = [math.exp(float(batch.old[row, t] - batch.rollout[row, t])) for t in tokens]
    level = correction.level or ("geometric" if algorithm == "gspo" else "token")
    if level == "token":
        raw = rho
    else:
        log_total = sum(math.log(r) for r in rho)
        log_total = log_total if level == "sequence" else log_total / len(rho)
        raw = [math.exp(max(-20.0, min(20.0, log_total)))] * len(rho)
    upper = correction.upper
    if correction.mode == "truncate":
        lower = correction.lower or 0.0
        weights = [min(max(w, lower), upper) for w in raw]
    else:
        lower = correction.lower if correction.lower is not None else 1 / upper
        weights = [w if lower <= w <= upper else 0.0 for w in raw]
    if correction.veto is not None and any(r < correction.veto for r in rho):
        weights = [0.0] * len(rho)
    return weights if correction.enabled else [1.0] * len(rho)


def reference_loss(batch: Batch, objective: Objective) -> torch.Tensor:
    """ppo: token-mean of the clipped surrogate times the weight; grpo: seq-mean-token-mean; gspo: the GSPO paper's
    sequence ratio s = (pi_new(y) / pi_old(y)) ** (1 / |y|), its clipped surrogate times the sequence's weight, or, at
    token level, verl's GSPO-token form (each token's term worth s, with its own logprob's gradient)."""
    algorithm = objective.algorithm.value
    correction = objective.rollout_correction
    terms: list[list[torch.Tensor]] = []
    for row in range(batch.mask.shape[0]):
        tokens = kept_of(batch, row)
        if not tokens:
            continue
        weights = reference_weights(batch, row, correction, algorithm)
        advantage = float(batch.advantages[row])
        log_ratios = [batch.new[row, t] - batch.old[row, t] for t in tokens]
        if algorithm == "gspo":
            mean = sum(log_ratios) / len(tokens)
            ratios = [torch.exp(mean.detach() + lr - lr.detach()) for lr in log_ratios]
        else:
            ratios = [torch.exp(lr) for lr in log_ratios]
        clipped = [
            torch.minimum(r * advantage, r.clamp(1 - EPS_LOW, 1 + EPS_HIGH) * advantage) * w
            for r, w in zip(ratios, weights, strict=True)
        ]
        terms.append(clipped)
    if not terms:
        return torch.tensor(0.0)
    if algorithm == "ppo":
        return -sum(t for row in terms for t in row) / sum(len(row) for row in terms)
    return -sum(sum(row) / len(row) for row in terms) / len(terms)


def gspo_sequence_loss(batch: Batch, objective: Objective) -> torch.Tensor:
    """The GSPO paper's loss with one weight per sequence: -mean_i min(s_i A_i, clip(s_i) A_i) w_i."""
    losses = []
    for row in range(batch.mask.shape[0]):
        tokens = kept_of(batch, row)
        if tokens:
            [weight, *_] = reference_weights(batch, row, objective.rollout_correction, "gspo")
            s = torch.exp(sum(batch.new[row, t] - batch.old[row, t] for t in tokens) / len(tokens))
            advantage = float(batch.advantages[row])
            losses.append(-torch.minimum(s * advantage, s.clamp(1 - EPS_LOW, 1 + EPS_HIGH) * advantage) * weight)
    return sum(losses) / len(losses)


def reference_metrics(batch: Batch, objective: Objective) -> dict[str, float]:
    """Each metric from its published definition (verl's rollout_corr and debug metrics, PipelineRL's ESS)."""
    algorithm, correction = objective.algorithm.value, objective.rollout_correction
    entropy = batch.entropy
    assert entropy is not None
    rows = [row for row in range(batch.mask.shape[0]) if kept_of(batch, row)]
    old = {row: [float(batch.old[row, t]) for t in kept_of(batch, row)] for row in rows}
    behaviour = {row: [float(batch.rollout[row, t]) for t in kept_of(batch, row)] for row in rows}
    new = {row: [float(batch.new[row, t].detach()) for t in kept_of(batch, row)] for row in rows}
    flat_old = [x for row in rows for x in old[row]]
    flat_behaviour = [x for row in rows for x in behaviour[row]]
    n = len(flat_old)
    rho = [math.exp(a - b) for a, b in zip(flat_old, flat_behaviour, strict=True)]
    level = correction.level or ("geometric" if algorithm == "gspo" else "token")
    upper = correction.upper
    lower = correction.lower if correction.lower is not None else (0.0 if correction.mode == "truncate" else 1 / upper)
    raw_units: list[float] = []
    applied_units: list[float] = []
    for row in rows:
        weights = reference_weights(batch, row, correction, algorithm)
        r = [math.exp(a - b) for a, b in zip(old[row], behaviour[row], strict=True)]
        if level == "token":
            raw_units += r
            applied_units += weights
        else:
            total = sum(a - b for a, b in zip(old[row], behaviour[row], strict=True))
            total = total if level == "sequence" else total / len(r)
            raw_units.append(math.exp(max(-20.0, min(20.0, total))))
            applied_units.append(weights[0])
    masked = sum(w == 0 for row in rows for w in reference_weights(batch, row, correction, algorithm))
    p, q = [math.exp(x) for x in flat_old], [math.exp(x) for x in flat_behaviour]
    mp, mq = sum(p) / n, sum(q) / n
    covariance = sum((a - mp) * (b - mq) for a, b in zip(p, q, strict=True))
    pearson = covariance / math.sqrt(sum((a - mp) ** 2 for a in p) * sum((b - mq) ** 2 for b in q))
    mean_old = [sum(old[row]) / len(old[row]) for row in rows]
    mean_behaviour = [sum(behaviour[row]) / len(behaviour[row]) for row in rows]
    x = [a - b for row in rows for a, b in zip(new[row], old[row], strict=True)]
    if algorithm == "gspo":
        ratios = [
            math.exp(sum(new[row][k] - old[row][k] for k in range(len(old[row]))) / len(old[row])) for row in rows
        ]
    else:
        ratios = [math.exp(v) for v in x]
    clip_rate = sum(not (1 - EPS_LOW <= r <= 1 + EPS_HIGH) for r in ratios) / len(ratios)
    applied_mean = sum(applied_units) / len(applied_units)
    return {
        "loss": float(reference_loss(batch, objective).detach()),
        "clamp_log_ratio_new_old_indicator": clip_rate,
        "kl_new_old": sum(math.exp(v) - v - 1 for v in x) / n,
        "ess": sum(rho) ** 2 / (n * sum(r * r for r in rho)),
        "mean_abs_logprob_diff": sum(abs(a - b) for a, b in zip(flat_old, flat_behaviour, strict=True)) / n,
        "tis_weight_mean": applied_mean,
        "rollout_is_mean": sum(raw_units) / len(raw_units),
        "rollout_is_eff_sample_size": (
            1 / (sum((w / applied_mean) ** 2 for w in applied_units) / len(applied_units)) if applied_mean else 0.0
        ),
        "rollout_is_ratio_fraction_high": sum(w > upper for w in raw_units) / len(raw_units),
        "rollout_is_ratio_fraction_low": sum(w < lower for w in raw_units) / len(raw_units),
        "rollout_is_masked_fraction": masked / n if correction.enabled else 0.0,
        "training_ppl": sum(math.exp(-m) for m in mean_old) / len(rows),
        "rollout_ppl": sum(math.exp(-m) for m in mean_behaviour) / len(rows),
        "log_ppl_diff": sum(b - a for a, b in zip(mean_old, mean_behaviour, strict=True)) / len(rows),
        "k3_kl": sum(r - math.log(r) - 1 for r in rho) / n,
        "chi2_token": sum(r * r for r in rho) / n - 1,
        "chi2_seq": sum(
            math.exp(2 * max(-20.0, min(20.0, sum(a - b for a, b in zip(old[row], behaviour[row], strict=True)))))
            for row in rows
        )
        / len(rows)
        - 1,
        "rollout_probs_diff_mean": sum(abs(a - b) for a, b in zip(p, q, strict=True)) / n,
        "rollout_probs_diff_max": max(abs(a - b) for a, b in zip(p, q, strict=True)),
        "rollout_actor_probs_pearson_corr": pearson,
        "entropy": sum(float(entropy[row, t]) for row in rows for t in kept_of(batch, row)) / n,
    }


CORRECTIONS = [
    {},
    {"enabled": False},
    {"level": "token", "mode": "truncate", "upper": 1.5, "lower": 0.5},
    {"level": "sequence", "mode": "truncate", "upper": 3.0},
    {"level": "geometric", "mode": "truncate", "upper": 1.2},
    {"level": "token", "mode": "mask", "upper": 2.0},
    {"level": "token", "mode": "mask", "upper": 5.0, "lower": 0.5},
    {"level": "sequence", "mode": "mask", "upper": 3.0},
    {"level": "geometric", "mode": "mask", "upper": 1.3, "lower": 0.8},
    {"level": "token", "mode": "truncate", "veto": 0.5},
    {"level": "geometric", "mode": "mask", "upper": 2.0, "veto": 0.3},
]


@pytest.mark.parametrize("algorithm", ["ppo", "grpo", "gspo"])
@pytest.mark.parametrize(
    "correction", CORRECTIONS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default"
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_loss_its_gradient_and_the_metrics_are_the_references(
    algorithm: str, correction: dict[str, Any], seed: int
) -> None:
    batch = random_batch(seed)
    chosen = objective(algorithm, **correction)
    loss, statistics = policy_loss(batch, chosen)
    (gradient,) = torch.autograd.grad(loss, batch.new)
    expected = reference_loss(batch, chosen)
    (expected_gradient,) = torch.autograd.grad(expected, batch.new)
    torch.testing.assert_close(loss, expected.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gradient, expected_gradient, rtol=1e-5, atol=1e-7)
    metrics = statistics.metrics()
    for name, value in reference_metrics(batch, chosen).items():
        assert metrics[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name
    assert all(math.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("level", ["sequence", "geometric"])
@pytest.mark.parametrize("seed", [0, 1])
def test_gspo_with_one_weight_per_sequence_is_the_papers_sequence_form(level: str, seed: int) -> None:
    batch = random_batch(seed)
    chosen = objective("gspo", level=level, upper=2.0)
    loss, _ = policy_loss(batch, chosen)
    (gradient,) = torch.autograd.grad(loss, batch.new)
    expected = gspo_sequence_loss(batch, chosen)
    (expected_gradient,) = torch.autograd.grad(expected, batch.new)
    torch.testing.assert_close(loss, expected.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gradient, expected_gradient, rtol=1e-5, atol=1e-7)


def todays_tis_loss(batch: Batch, algorithm: str) -> torch.Tensor:
    """The objective before the correction suite, with truncatedImportanceSampling {enabled: true, cap: 2} (the
    code as it was, on batches whose every sequence has a kept token)."""
    mask = batch.mask
    log_ratio = batch.new - batch.old
    mismatch = (batch.old - batch.rollout) * mask
    low, high = 1 - EPS_LOW, 1 + EPS_HIGH

    def per_sequence_mean(values: torch.Tensor) -> torch.Tensor:
        return (values * mask).sum(-1) / mask.sum(-1).clamp(min=1)

    if algorithm == "gspo":
        ratio = torch.exp(per_sequence_mean(log_ratio))
        surrogate = torch.minimum(ratio * batch.advantages, ratio.clamp(low, high) * batch.advantages)
        return -(surrogate * torch.exp(per_sequence_mean(mismatch)).clamp(max=2.0)).mean()
    ratio = torch.exp(log_ratio)
    advantages = batch.advantages[:, None]
    weighted = torch.minimum(ratio * advantages, ratio.clamp(low, high) * advantages) * torch.exp(mismatch).clamp(max=2)
    if algorithm == "grpo":
        return -per_sequence_mean(weighted).mean()
    return -(weighted * mask).sum() / mask.sum()


@pytest.mark.parametrize("algorithm", ["ppo", "grpo", "gspo"])
def test_the_default_correction_is_todays_truncated_importance_sampling_with_cap_2(algorithm: str) -> None:
    batch = random_batch(3, empty=False)
    default = Objective(algorithm=Algorithm(algorithm), clip_epsilon_low=EPS_LOW, clip_epsilon_high=EPS_HIGH)
    assert default.rollout_correction == RolloutCorrection(mode=CorrectionMode.TRUNCATE, upper=2.0)
    loss, _ = policy_loss(batch, default)
    (gradient,) = torch.autograd.grad(loss, batch.new)
    before = todays_tis_loss(batch, algorithm)
    (gradient_before,) = torch.autograd.grad(before, batch.new)
    torch.testing.assert_close(loss, before, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gradient, gradient_before, rtol=1e-5, atol=1e-7)


def test_the_correction_is_kept_apart_from_the_policy_ratio() -> None:
    """Moving the behaviour logprobs changes the weights only: on policy (new = old) nothing is clipped, whatever
    the mismatch, and the gradient is the advantage times the weight."""
    batch = random_batch(4, spread=3.0)
    on_policy = Batch(batch.old.clone().requires_grad_(True), batch.old, batch.rollout, batch.advantages, batch.mask)
    chosen = objective("ppo", level=CorrectionLevel.TOKEN, upper=2.0)
    loss, statistics = policy_loss(on_policy, chosen)
    assert statistics.metrics()["clamp_log_ratio_new_old_indicator"] == 0.0
    assert statistics.metrics()["rollout_is_ratio_fraction_high"] > 0.2, "the mismatch is large here"
    (gradient,) = torch.autograd.grad(loss, on_policy.new)
    weight = torch.exp(batch.old - batch.rollout).clamp(max=2.0) * batch.mask
    torch.testing.assert_close(gradient, -batch.advantages[:, None] * weight / batch.mask.sum())


def test_a_sequence_without_kept_tokens_counts_for_nothing() -> None:
    """Issue 24's items 2 and 3 of Why: no NaN, and the gspo loss does not count it with ratio 1 and weight 1."""
    batch = random_batch(5, empty=False)
    rows = [0, 1, 2, 3, 4, 5]
    emptied = batch.mask.clone()
    emptied[2] = 0
    without = [r for r in rows if r != 2]
    for algorithm in ("ppo", "grpo", "gspo"):
        chosen = objective(algorithm)
        with_empty = Batch(batch.new, batch.old, batch.rollout, batch.advantages, emptied, batch.entropy)
        dropped = rows_of(batch, without)
        _, measured = policy_loss(with_empty, chosen)
        _, expected = policy_loss(dropped, chosen)
        assert measured.metrics() == pytest.approx(expected.metrics(), rel=1e-6, abs=1e-7), algorithm
    nothing = Batch(batch.new, batch.old, batch.rollout, batch.advantages, torch.zeros_like(batch.mask), batch.entropy)
    loss, statistics = policy_loss(nothing, objective("gspo"))
    assert loss.item() == 0.0 and all(math.isfinite(v) for v in statistics.metrics().values())
    _, whole = policy_loss(batch, objective("gspo"))
    assert (whole + statistics).metrics() == whole.metrics(), "an empty micro-batch adds nothing"


# -- invariance: any micro-batch size, any number of ranks ----------------------------------------------------------


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 10_000),
    sequences=st.integers(1, 9),
    cuts=st.lists(st.integers(1, 8), max_size=4),
    algorithm=st.sampled_from(["ppo", "grpo", "gspo"]),
    correction=st.sampled_from(CORRECTIONS),
)
def test_every_metric_is_the_same_for_any_split_of_the_batch(
    seed: int, sequences: int, cuts: list[int], algorithm: str, correction: dict[str, Any]
) -> None:
    """Any split of the rows (micro-batches on one rank, or the ranks' shares: their statistics are added, as
    across_ranks adds them over the ranks) measures what the whole batch does in one pass."""
    batch = random_batch(seed, sequences=sequences)
    chosen = objective(algorithm, **correction)
    _, whole = policy_loss(batch, chosen)
    bounds = sorted({0, sequences, *(c for c in cuts if c < sequences)})
    parts = [list(range(a, b)) for a, b in itertools.pairwise(bounds)]
    split = Statistics()
    for rows in parts:
        part = rows_of(batch, rows)
        split += policy_loss(part, chosen)[1]
    back = Statistics.from_floats(split.as_floats())
    assert back.metrics() == pytest.approx(whole.metrics(), rel=1e-6, abs=1e-7)
