"""What a step learns from beyond the reward function's own value: DAPO's overlong handling
(spec.trainer.rollout.overlong) of completions cut at maxTokens.

A completion's length is the number of tokens the policy sampled (``policy_tokens``); it is cut when that reaches
maxTokens (the actors report no finish reason). Pure functions: the trainer applies them to a step's rollouts and
rewards.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from lockstep.api import Overlong, OverlongMode
from lockstep_workers.rollout.record import Rollout


def policy_tokens(rollout: Rollout) -> int:
    """How many of the completion's tokens the policy sampled (every turn's, in a multi-turn episode)."""
    return sum(rollout.policy_mask) if rollout.policy_mask else len(rollout.completion)


def is_cut(rollout: Rollout, max_tokens: int) -> bool:
    """Whether the completion reached maxTokens."""
    return policy_tokens(rollout) >= max_tokens


def overlong_penalty(length: int, max_tokens: int, window: int, factor: float = 1.0) -> float:
    """DAPO's soft overlong punishment of a completion of ``length`` tokens: 0 up to max_tokens - window, then
    falling linearly to -factor at max_tokens, -factor beyond."""
    start = max_tokens - window
    if length <= start:
        return 0.0
    return -factor * (min(length - start, window) / window)


def penalties(rollouts: Sequence[Rollout], max_tokens: int, overlong: Overlong | None) -> list[float]:
    """Each completion's overlong penalty, added to its reward: all 0 unless ``overlong`` is mode penalty."""
    if overlong is None or overlong.mode is not OverlongMode.PENALTY:
        return [0.0] * len(rollouts)
    assert overlong.window is not None  # the CRD's rule: a penalty has its window
    return [overlong_penalty(policy_tokens(r), max_tokens, overlong.window, overlong.factor) for r in rollouts]


def masked_if_cut(rollouts: Sequence[Rollout], max_tokens: int, overlong: Overlong | None) -> list[Rollout]:
    """``rollouts``, each cut one with no token in the loss when ``overlong`` is mode mask."""
    if overlong is None or overlong.mode is not OverlongMode.MASK:
        return list(rollouts)
    return [replace(r, policy_mask=[False] * len(r.completion)) if is_cut(r, max_tokens) else r for r in rollouts]


def overlong_metrics(rollouts: Sequence[Rollout], max_tokens: int, overlong: Overlong | None) -> dict[str, float]:
    """The step's ``truncated_fraction`` (completions cut at maxTokens) and, with the penalty, its mean
    ``overlong_penalty``."""
    metrics = {"truncated_fraction": sum(is_cut(r, max_tokens) for r in rollouts) / len(rollouts)}
    if overlong is not None and overlong.mode is OverlongMode.PENALTY:
        metrics["overlong_penalty"] = sum(penalties(rollouts, max_tokens, overlong)) / len(rollouts)
    return metrics
