"""The step's metrics beside the learner's: what dynamic sampling cost, each reward function's part, and where the
step's time went (tokens per second, the actors' busy share, the sequences learned at each lag)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from lockstep_workers.rollout.producer import Group, StepGroups
from lockstep_workers.rollout.record import Rollout, lag_of
from lockstep_workers.trainer.pod import (
    LAG_PREFIX,
    LAG_SUFFIX,
    REWARD_PART_PREFIX,
)

if TYPE_CHECKING:
    pass

logger = logging.getLogger("lockstep.trainer")


def dynamic_sampling_metrics(taken: StepGroups) -> dict[str, float]:
    """What dynamic sampling cost a step (spec.trainer.rollout.dynamicSampling): the groups it dropped for equal
    rewards, those it sampled beyond promptsPerStep, and those without signal it learned because its extra groups
    ran out."""
    return {
        "dropped_groups": float(taken.dropped),
        "extra_groups": float(taken.extra),
        "unfilled_groups": float(taken.unfilled),
    }


def reward_part_metrics(groups: Sequence[Group]) -> dict[str, float]:
    """Each reward function's mean reward over the step's completions, before its weight, as rewards/<name>."""
    names = groups[0].reward_parts
    return {
        f"{REWARD_PART_PREFIX}{name}": sum(sum(g.reward_parts[name]) for g in groups)
        / sum(len(g.rewards) for g in groups)
        for name in names
    }


def pipeline_metrics(
    rollouts: Sequence[Rollout], version: int, max_lag: int, generated: int, interval: float, busy: float | None
) -> dict[str, float]:
    """Where the step's time went, beside its learn and wait seconds: tokens generated (``generated``, by the
    actors, kept or dropped) and learned per second of ``interval`` (since the previous step's), the actors' busy
    fraction (``busy``; left out when no actor reports it), the sequences learned at each lag behind ``version``
    (``lag_<n>_sequences``, n from 0 to ``max_lag``) and how many span versions."""
    learned = sum(len(r.completion) for r in rollouts)
    lags = [lag_of(r, version) for r in rollouts]
    metrics = {
        "tokens_generated_per_second": generated / interval,
        "tokens_learned_per_second": learned / interval,
        "spanning_sequences": float(sum(len(set(r.versions)) > 1 for r in rollouts)),
        **{f"{LAG_PREFIX}{n}{LAG_SUFFIX}": float(lags.count(n)) for n in range(max_lag + 1)},
    }
    if busy is not None:
        metrics["actor_busy_fraction"] = busy
    return metrics


def busy_fraction(before: dict[str, float], after: dict[str, float], interval: float) -> float | None:
    """The mean over the actors that reported both times of their busy share of ``interval``."""
    shares = [min(1.0, (after[url] - before[url]) / interval) for url in after if url in before]
    return sum(shares) / len(shares) if shares else None
