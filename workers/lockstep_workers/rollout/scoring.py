"""Scoring completions with the job's reward functions (spec.trainer.reward, or several weighted, .rewards) in a pool
of processes (spec.trainer.rewardProcesses), so that a slow reward runs beside the others and a crashing one cannot
take the trainer's own state with it.

A reward whose parameters include ``completion``, ``prompt`` and ``row`` is called with those keywords (the decoded
completion, the prompt's text, its dataset row); any other with (prompt token ids, completion token ids). A reward
that raises, or returns NaN or an infinity (which would reach the loss and the trainer's reports), is counted, logged
with the row, and scored as spec.trainer.onRewardError says: Zero scores it 0, Fail stops the trainer
(RewardFailed). So is a completion whose weighted sum of several functions' rewards overflows, naming the function
whose weighted reward is the largest: Zero scores the completion 0.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import math
import multiprocessing
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

from lockstep.api import RewardErrorAction, WeightedReward

logger = logging.getLogger("lockstep.trainer")

TEXT_PARAMETERS = frozenset({"completion", "prompt", "row"})
"""The parameters that make a reward one on text."""


def load_callable(reference: str) -> Any:
    """The callable named ``package.module:function`` (RLJob spec.trainer.reward and .prompts)."""
    module, _, name = reference.partition(":")
    if not name:
        raise ValueError(f"{reference!r}: expected 'package.module:function'")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"{reference!r} cannot be imported in the trainer's image: {error}") from error


def takes_text(function: Callable[..., Any]) -> bool:
    """Whether ``function`` is a reward on text: reward(completion, prompt, row)."""
    return set(inspect.signature(function).parameters) >= TEXT_PARAMETERS


@dataclass(frozen=True)
class RewardInput:
    """What a reward may see of one completion."""

    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    prompt: str
    completion: str
    row: dict[str, Any]


@dataclass(frozen=True)
class Outcome:
    """One completion's reward, or the error the reward function raised on it (formatted with its traceback)."""

    reward: float | None = None
    error: str | None = None


@functools.cache
def _reward(reference: str) -> tuple[Callable[..., Any], bool]:
    function = load_callable(reference)
    return function, takes_text(function)


def score(reference: str, sample: RewardInput) -> Outcome:
    """Call the reward ``reference`` on ``sample`` (in a pool process)."""
    function, text = _reward(reference)
    try:
        if text:
            value = function(completion=sample.completion, prompt=sample.prompt, row=sample.row)
        else:
            value = function(sample.prompt_token_ids, sample.completion_token_ids)
        reward = float(value)
    except Exception:
        return Outcome(error=traceback.format_exc())
    if not math.isfinite(reward):
        return Outcome(error=f"ValueError: the reward function returned {reward}, not a finite number")
    return Outcome(reward=reward)


class RewardFailed(RuntimeError):
    """A reward function raised and spec.trainer.onRewardError is Fail."""


@dataclass(frozen=True)
class Scores:
    """Some samples' rewards: each function's own (``parts``, by name) and their weighted sum (``rewards``), and how
    many (sample, function) pairs the functions raised on."""

    rewards: list[float]
    parts: dict[str, list[float]]
    errors: int


def weighted_sum(parts: Sequence[Sequence[float]], weights: Sequence[float]) -> list[float]:
    """Each sample's sum over the functions of its reward times the function's weight (``parts``: one list of the
    samples' rewards per function)."""
    return [sum(w * r for w, r in zip(weights, rewards, strict=True)) for rewards in zip(*parts, strict=True)]


class Scorer:
    """The job's reward functions, run by ``processes`` processes forked when it is made (make it before the trainer
    starts threads: torch.distributed, the metrics server)."""

    def __init__(self, functions: Sequence[WeightedReward], on_error: RewardErrorAction, processes: int) -> None:
        for function in functions:
            _reward(function.function)  # an unimportable reward stops the trainer here, with its name
        self.functions = list(functions)
        self.on_error = on_error
        self.processes = processes
        self.pool = ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("fork"))
        # The fork context starts every process at the first task: now, before the caller starts threads.
        self.pool.submit(_reward, self.functions[0].function).result()

    def scores(self, samples: Sequence[RewardInput]) -> Scores:
        """Each sample's rewards (a function that raised is logged with the row and scores 0, or with onRewardError
        Fail, RewardFailed is raised; so is a sample whose weighted sum is not finite, whose reward is then 0)."""
        references = [function.function for function in self.functions for _ in samples]
        chunk = max(1, len(references) // (4 * self.processes))
        outcomes = list(self.pool.map(score, references, [*samples] * len(self.functions), chunksize=chunk))
        parts: dict[str, list[float]] = {}
        errors = 0
        for n, function in enumerate(self.functions):
            mine = outcomes[n * len(samples) : (n + 1) * len(samples)]
            for sample, outcome in zip(samples, mine, strict=True):
                if outcome.reward is None:
                    errors += 1
                    self._failed(function.function, outcome.error or "", sample)
            parts[function.name] = [0.0 if outcome.reward is None else outcome.reward for outcome in mine]
        rewards = weighted_sum(list(parts.values()), [function.weight for function in self.functions])
        for n, (sample, reward) in enumerate(zip(samples, rewards, strict=True)):
            if not math.isfinite(reward):
                errors += 1
                self._failed(*self._overflow(parts, n, reward), sample)
                rewards[n] = 0.0
        return Scores(rewards, parts, errors)

    def _overflow(self, parts: dict[str, list[float]], n: int, total: float) -> tuple[str, str]:
        """The reward function to blame for sample ``n``'s weighted sum ``total`` not being finite (each reward is
        finite: the largest weighted one) and why."""
        largest = max(self.functions, key=lambda function: abs(function.weight * parts[function.name][n]))
        reward = parts[largest.name][n]
        return largest.function, (
            f"ValueError: the weighted sum of the rewards is {total}: this function returned {reward}, times its "
            f"weight {largest.weight} in spec.trainer.rewards"
        )

    def _failed(self, reference: str, error: str, sample: RewardInput) -> None:
        logger.warning(
            "the reward function %s raised on row %s (prompt %r, completion %r), scored as onRewardError %s says:\n%s",
            reference,
            sample.row,
            sample.prompt,
            sample.completion,
            self.on_error.value,
            error,
        )
        if self.on_error is RewardErrorAction.FAIL:
            raise RewardFailed(
                f"the reward function {reference} raised on row {sample.row}: "
                f"{error.strip().splitlines()[-1]}. spec.trainer.onRewardError is Fail; fix the reward or the row, "
                "or set onRewardError: Zero to score such completions 0"
            )

    def close(self) -> None:
        self.pool.shutdown(cancel_futures=True)

    def __enter__(self) -> Scorer:
        return self

    def __exit__(self, *exception: object) -> None:
        self.close()
