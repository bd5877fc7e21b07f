"""What a step learns from beyond the reward function's value (lockstep_workers.trainer.shaping): DAPO's soft overlong
punishment as the paper writes it, which completions mode mask keeps out of the loss, and each of several reward
functions' step metric."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lockstep.api import Overlong, OverlongMode
from lockstep_workers.rollout.producer import Group
from lockstep_workers.rollout.record import Rollout
from lockstep_workers.trainer.metrics import reward_part_metrics
from lockstep_workers.trainer.shaping import masked_if_cut, overlong_metrics, overlong_penalty, penalties, policy_tokens


def dapo_penalty(length: int, max_tokens: int, window: int) -> float:
    """DAPO (Yu et al. 2025, eq. 13): 0 if L <= M - W; ((M - W) - L) / W if M - W < L <= M; -1 if M < L."""
    if length <= max_tokens - window:
        return 0.0
    if length <= max_tokens:
        return ((max_tokens - window) - length) / window
    return -1.0


@given(
    max_tokens=st.integers(1, 4096),
    window_share=st.floats(0.0, 1.0),
    length_share=st.floats(0.0, 1.5),
    factor=st.floats(0.01, 10.0),
)
def test_the_penalty_is_dapos_soft_overlong_punishment_scaled_by_the_factor(
    max_tokens: int, window_share: float, length_share: float, factor: float
) -> None:
    window = max(1, round(window_share * max_tokens))
    length = round(length_share * max_tokens)
    penalty = overlong_penalty(length, max_tokens, window, factor)
    assert penalty == pytest.approx(factor * dapo_penalty(length, max_tokens, window), abs=1e-12)
    assert -factor <= penalty <= 0
    assert penalty >= overlong_penalty(length + 1, max_tokens, window, factor), "longer is never better"


def rollout(length: int, policy_mask: list[bool] | None = None) -> Rollout:
    return Rollout([1], [5] * length, [0.0] * length, 0, [], policy_mask or [])


PENALTY = Overlong(mode=OverlongMode.PENALTY, window=4, penalty_factor=0.5)
MASK = Overlong(mode=OverlongMode.MASK)


def test_mode_mask_keeps_only_the_completions_cut_at_max_tokens_out_of_the_loss() -> None:
    rollouts = [rollout(3), rollout(8), rollout(9, [True] * 6 + [False] * 3)]
    kept = masked_if_cut(rollouts, 8, MASK)
    assert kept[0] is rollouts[0] and kept[2] is rollouts[2], "6 policy tokens of 8: not cut"
    assert kept[1].policy_mask == [False] * 8 and kept[1].completion == rollouts[1].completion
    assert masked_if_cut(rollouts, 8, PENALTY) == rollouts == masked_if_cut(rollouts, 8, None)
    assert [policy_tokens(r) for r in rollouts] == [3, 8, 6]


def test_the_step_metrics_count_cut_completions_and_average_the_penalty_over_every_completion() -> None:
    rollouts = [rollout(2), rollout(6), rollout(8), rollout(8)]
    assert penalties(rollouts, 8, PENALTY) == [0.0, -0.25, -0.5, -0.5]
    assert penalties(rollouts, 8, MASK) == [0.0] * 4 == penalties(rollouts, 8, None)
    assert overlong_metrics(rollouts, 8, PENALTY) == {"truncated_fraction": 0.5, "overlong_penalty": -1.25 / 4}
    assert overlong_metrics(rollouts, 8, MASK) == {"truncated_fraction": 0.5}


def test_each_reward_functions_step_metric_is_its_mean_over_the_steps_completions() -> None:
    groups = [
        Group(0, [], [], [1.1, 0.0], 0, {"correct": [1.0, 0.0], "format": [1.0, 0.0]}),
        Group(1, [], [], [1.1, 1.1, 0.1], 0, {"correct": [1.0, 1.0, 0.0], "format": [1.0, 1.0, 1.0]}),
    ]
    assert reward_part_metrics(groups) == {"rewards/correct": 3 / 5, "rewards/format": 4 / 5}
