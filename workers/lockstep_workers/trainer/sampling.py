"""What trainer rank 0 samples and how it is scored: the job's rollout function, each step's prompts from its dataset
or prompt source, and the rewards of a prompt group's completions (with spec.trainer.rollout.overlong's penalty)."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from lockstep.api import RolloutSettings, Training
from lockstep_workers.episodes import RolloutFunction, single_turn
from lockstep_workers.rollout.dataset import DatasetError, Prompt, PromptDataset
from lockstep_workers.rollout.producer import Group
from lockstep_workers.rollout.record import Rollout
from lockstep_workers.rollout.scoring import RewardInput, Scorer, Scores, load_callable
from lockstep_workers.trainer.shaping import penalties

if TYPE_CHECKING:
    pass

logger = logging.getLogger("lockstep.trainer")


PromptSource = Callable[[int, int, int], list[list[int]]]
"""prompts(step, count, seed) -> ``count`` prompts as token id lists."""


def load_rollout_function(reference: str | None) -> RolloutFunction:
    """spec.trainer.rollout.function (an async function), or the single turn when unset."""
    if reference is None:
        return single_turn
    function = load_callable(reference)
    if not inspect.iscoroutinefunction(function):
        raise ValueError(
            f"spec.trainer.rollout.function {reference!r} is not an async function: define it with 'async def "
            "function(row, prompt_token_ids, client)' (lockstep_workers.episodes)"
        )
    chosen: RolloutFunction = function
    return chosen


class Prompts:
    """Rank 0's prompts: each step's, from the job's dataset or its prompt source, and the eval split's; and the
    reward's view of their completions."""

    def __init__(self, settings: Training, model_path: str) -> None:
        from transformers import AutoTokenizer

        self.settings = settings
        self.tokenizer: Any = AutoTokenizer.from_pretrained(model_path)
        self.dataset: PromptDataset | None = None
        if settings.dataset is not None:
            try:
                self.dataset = PromptDataset(settings.dataset, self.tokenizer)
            except DatasetError as error:
                raise SystemExit(f"spec.trainer.dataset: {error}") from error
        self.source: PromptSource = load_callable(settings.prompts)
        self._steps: dict[int, list[Prompt]] = {}
        """The prompts of the steps whose positions are being sampled (a step's are made together)."""

    def step(self, step: int) -> list[Prompt]:
        count = self.settings.rollout.prompts_drawn_per_step
        if self.dataset is not None:
            return self.dataset.step_prompts(step, count)
        token_ids = self.source(step, count, self.settings.seed)
        return [Prompt(ids, self.tokenizer.decode(ids), {}) for ids in token_ids]

    def at(self, position: int) -> Prompt:
        """The prompt at ``position`` in the job's sequence (lockstep_workers.rollout.producer): step position // count
        + 1's prompt position % count, ``count`` the prompts each step draws."""
        count = self.settings.rollout.prompts_drawn_per_step
        step = position // count + 1
        if step not in self._steps:
            # Keep the step before (its dropped groups may be sampled again); an evicted step's are made again.
            self._steps = {s: p for s, p in self._steps.items() if s >= step - 1}
            self._steps[step] = self.step(step)
        return self._steps[step][position % count]

    def evaluation(self) -> list[Prompt]:
        return self.dataset.eval_prompts(self.settings.eval.prompts) if self.dataset is not None else []

    def reward_inputs(self, rollouts: list[Rollout], prompts: list[Prompt]) -> list[RewardInput]:
        return [
            RewardInput(
                r.prompt,
                r.completion,
                prompts[r.group].text,
                self.tokenizer.decode(r.completion, skip_special_tokens=True),
                prompts[r.group].row,
            )
            for r in rollouts
        ]


def score_group(
    prompts: Prompts, scorer: Scorer, rollout: RolloutSettings, rollouts: list[Rollout], prompt: Prompt
) -> tuple[list[RewardInput], Scores]:
    """What the reward saw of one prompt's samples (``rollouts``, of group 0) and their rewards, each with its
    overlong penalty (spec.trainer.rollout.overlong) added."""
    inputs = prompts.reward_inputs(rollouts, [prompt])
    scores = scorer.scores(inputs)
    penalised = penalties(rollouts, rollout.max_tokens, rollout.overlong)
    rewards = [reward + penalty for reward, penalty in zip(scores.rewards, penalised, strict=True)]
    return inputs, replace(scores, rewards=rewards)


def batch_of(groups: Sequence[Group]) -> tuple[list[Rollout], list[RewardInput], list[float], int]:
    """A step's rollouts (group n: its nth prompt), what the reward saw of them, their rewards and reward errors."""
    rollouts = [replace(r, group=n) for n, group in enumerate(groups) for r in group.rollouts]
    inputs = [sample for group in groups for sample in group.inputs]
    rewards = [reward for group in groups for reward in group.rewards]
    return rollouts, inputs, rewards, sum(group.reward_errors for group in groups)
