"""spec.trainer.eval: the mean reward of one greedy completion of each eval row, sampled from the actors beside the
training requests."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from lockstep_workers.rollout.producer import RolloutProducer
from lockstep_workers.rollout.scoring import Scorer
from lockstep_workers.trainer.pod import (
    EVAL_REWARD,
    EVAL_ROWS,
)
from lockstep_workers.trainer.sampling import Prompts

if TYPE_CHECKING:
    pass

logger = logging.getLogger("lockstep.trainer")


GREEDY = {"temperature": 0.0, "top_p": 1.0}
"""How an evaluation samples."""


def evaluate(producer: RolloutProducer, prompts: Prompts, scorer: Scorer, max_tokens: int) -> dict[str, float]:
    """The mean reward of one greedy completion of each eval row, from the actors (beside the training requests),
    and how many rows."""
    evaluated = prompts.evaluation()
    sampled = producer.evaluate([p.token_ids for p in evaluated], {**GREEDY, "max_tokens": max_tokens})
    rewards = scorer.scores(prompts.reward_inputs(sampled, evaluated)).rewards
    return {EVAL_REWARD: sum(rewards) / len(rewards), EVAL_ROWS: float(len(rewards))}


def evaluation_due(step: int, every_steps: int) -> bool:
    """Whether the weights ``step`` starts from are evaluated before it: every ``every_steps`` steps from the first
    (0: never)."""
    return every_steps > 0 and (step - 1) % every_steps == 0
