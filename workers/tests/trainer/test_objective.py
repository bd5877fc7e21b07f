"""The objective and its metrics on batches whose answers are known."""

from __future__ import annotations

import math

import pytest
import torch

from lockstep.api import Algorithm, Objective, RolloutCorrection
from lockstep_workers.trainer import objective as objective_module
from lockstep_workers.trainer.objective import Batch


def policy_loss(batch: Batch, objective: Objective) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss and the metrics of one batch."""
    loss, statistics = objective_module.policy_loss(batch, objective)
    return loss, statistics.metrics()


def objective(algorithm: str = "ppo", tis: bool = False, cap: float = 2.0) -> Objective:
    return Objective(
        algorithm=Algorithm(algorithm),
        clip_epsilon_low=0.2,
        clip_epsilon_high=0.28,
        rollout_correction=RolloutCorrection(enabled=tis, upper=cap),
    )


def batch(
    new_minus_old: float = 0.0,
    old_minus_rollout: float = 0.0,
    advantages: tuple[float, ...] = (1.0, -1.0),
    mask: list[list[int]] | None = None,
) -> Batch:
    mask_tensor = torch.tensor(mask or [[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.float32)
    old = torch.full(mask_tensor.shape, -1.0)
    new = (old + new_minus_old).clone().requires_grad_(True)
    return Batch(
        new=new, old=old, rollout=old - old_minus_rollout, advantages=torch.tensor(advantages), mask=mask_tensor
    )


@pytest.mark.parametrize("algorithm", ["ppo", "grpo", "gspo"])
def test_on_policy_batch_has_no_clipping_no_kl_and_full_ess(algorithm: str) -> None:
    loss, metrics = policy_loss(batch(advantages=(1.0, 1.0)), objective(algorithm))
    assert loss.item() == pytest.approx(-1.0)
    assert metrics["clamp_log_ratio_new_old_indicator"] == 0
    assert metrics["kl_new_old"] == pytest.approx(0.0)
    assert metrics["ess"] == pytest.approx(1.0)
    assert metrics["mean_abs_logprob_diff"] == pytest.approx(0.0)


def test_ratio_beyond_the_trust_region_is_clipped_and_gets_no_gradient() -> None:
    data = batch(new_minus_old=math.log(1.5), advantages=(1.0, 1.0))
    loss, metrics = policy_loss(data, objective("ppo"))
    assert loss.item() == pytest.approx(-1.28)
    assert metrics["clamp_log_ratio_new_old_indicator"] == 1.0
    loss.backward()
    assert data.new.grad is not None and torch.all(data.new.grad == 0)
    assert metrics["kl_new_old"] == pytest.approx(1.5 - math.log(1.5) - 1)


def test_grpo_averages_within_each_sequence_first_and_ppo_over_all_tokens() -> None:
    ratio = math.log(1.1)
    advantages = (1.0, 3.0)  # sequence lengths 3 and 2
    ppo, _ = policy_loss(batch(new_minus_old=ratio, advantages=advantages), objective("ppo"))
    grpo, _ = policy_loss(batch(new_minus_old=ratio, advantages=advantages), objective("grpo"))
    assert ppo.item() == pytest.approx(-1.1 * (3 * 1.0 + 2 * 3.0) / 5)
    assert grpo.item() == pytest.approx(-1.1 * (1.0 + 3.0) / 2)


def test_gspo_uses_one_length_normalised_ratio_per_sequence() -> None:
    mask = [[1, 1, 0, 0], [1, 1, 1, 1]]
    data = batch(advantages=(1.0, 1.0), mask=mask)
    with torch.no_grad():
        data.new[0, 0] += math.log(1.44)  # sequence 0: mean log ratio = log(1.2)
    loss, metrics = policy_loss(data, objective("gspo"))
    assert loss.item() == pytest.approx(-(1.2 + 1.0) / 2)
    assert metrics["clamp_log_ratio_new_old_indicator"] == 0.0


def test_truncated_importance_sampling_caps_the_weight_and_the_metrics_see_the_mismatch() -> None:
    data = batch(old_minus_rollout=math.log(3.0), advantages=(1.0, 1.0))
    loss, metrics = policy_loss(data, objective("ppo", tis=True, cap=2.0))
    assert loss.item() == pytest.approx(-2.0), "weight min(3, C=2)"
    assert metrics["tis_weight_mean"] == pytest.approx(2.0)
    assert metrics["mean_abs_logprob_diff"] == pytest.approx(math.log(3.0))
    untruncated, _ = policy_loss(batch(old_minus_rollout=math.log(3.0), advantages=(1.0, 1.0)), objective("ppo"))
    assert untruncated.item() == pytest.approx(-1.0)


def test_ess_drops_when_importance_weights_are_uneven_and_padding_is_ignored() -> None:
    data = batch(advantages=(1.0, 1.0))
    rollout = data.old.clone()
    rollout[0, :3] -= math.log(4.0)  # three tokens with weight 4, two with weight 1; padding changed too
    rollout[:, 3] = 100.0
    uneven = Batch(new=data.new, old=data.old, rollout=rollout, advantages=data.advantages, mask=data.mask)
    _, metrics = policy_loss(uneven, objective("ppo"))
    weights = torch.tensor([4.0, 4.0, 4.0, 1.0, 1.0])
    assert metrics["ess"] == pytest.approx((weights.sum() ** 2 / (5 * (weights**2).sum())).item())


@pytest.mark.parametrize("log_rho", [30.0, 360.0, 800.0])
def test_one_token_far_off_policy_gives_finite_mismatch_metrics_clamped_as_verl_does(log_rho: float) -> None:
    data = batch(advantages=(1.0, 1.0))
    rollout = data.old.clone()
    rollout[0, 0] -= log_rho  # one token's log rho; the other four are on-policy
    far = Batch(new=data.new, old=data.old, rollout=rollout, advantages=data.advantages, mask=data.mask)
    _, metrics = policy_loss(far, objective("ppo"))
    assert all(math.isfinite(value) for value in metrics.values()), metrics
    rho = math.exp(objective_module.LOG_WEIGHT_BOUND)  # log rho clamped to 20, as verl's SAFETY_BOUND
    assert metrics["chi2_token"] == pytest.approx((rho**2 + 4) / 5 - 1)
    assert metrics["ess"] == pytest.approx((rho + 4) ** 2 / (5 * (rho**2 + 4)))
    assert metrics["mean_abs_logprob_diff"] == pytest.approx(log_rho / 5), "the measured difference is not clamped"


def test_a_nan_loss_stops_the_step_naming_the_inputs_that_are_not_finite() -> None:
    """Issue 37 item 1: a diverged model's NaN logprobs, or a NaN reward, reached the loss and the trainer's reports."""
    data = batch(advantages=(1.0, 1.0))
    with torch.no_grad():
        data.new[0, 1] = math.nan
    with pytest.raises(objective_module.NonFiniteLoss, match=r"the loss is nan, so the step stops before its optim"):
        policy_loss(data, objective("grpo"))
    with pytest.raises(objective_module.NonFiniteLoss, match=r"the trainer's logprobs \(new\): 1 not finite"):
        policy_loss(data, objective("ppo"))
    rollout = batch().old.clone()
    rollout[1, 0] = math.nan  # vLLM's logprob of a kept token
    broken = Batch(
        new=batch().new, old=batch().old, rollout=rollout, advantages=torch.tensor([1.0, 1.0]), mask=batch().mask
    )
    with pytest.raises(objective_module.NonFiniteLoss, match=r"the rollout logprobs \(vLLM's\): 1 not finite"):
        policy_loss(broken, objective("ppo", tis=True))
    padded = batch()
    with torch.no_grad():
        padded.new[0, 3] = math.nan  # a padding token: not in the loss
    loss, _ = policy_loss(padded, objective("ppo"))
    assert math.isfinite(loss.item())
