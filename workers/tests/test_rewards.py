"""Rewards: the built-in text rewards find the final answer in its usual spellings; the process pool runs rewards on
text and on token ids; a reward that raises is counted, logged with its row, and scored by onRewardError."""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest

from lockstep.api import RewardErrorAction
from lockstep_workers.rewards import final_answer, format, math_exact_match
from lockstep_workers.scoring import RewardFailed, RewardInput, Scorer, takes_text


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("so the total is \\boxed{72}.", "72"),
        ("\\boxed{\\frac{1}{2}} and later 3", "\\frac{1}{2}"),
        ("first \\boxed{1}, then \\boxed{ 2 }", "2"),
        ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72"),
        ("#### 1,234,567\n", "1234567"),
        ("the change is -5 degrees", "-5"),
        ("the change is \u22125 degrees", "-5"),
        ("it costs $1,250.50 in all", "1250.5"),
        ("3 apples and 7.0 pears", "7"),
        ("#### -0.50", "-0.5"),
        ("no answer here", None),
        ("words w3 and x2 are not numbers", None),
        ("", None),
    ],
)
def test_the_final_answer_is_found_and_normalised(text: str, answer: str | None) -> None:
    assert final_answer(text) == answer


@pytest.mark.parametrize(
    ("completion", "answer", "reward"),
    [
        ("\\boxed{1,000}", 1000, 1.0),
        ("#### 72", "She sold 48/2 = 24 clips in May.\n#### 72", 1.0),
        ("the answer is -3", "-3", 1.0),
        ("the answer is 3", "-3", 0.0),
        ("12.0", 12, 1.0),
        ("I do not know", "7", 0.0),
    ],
)
def test_math_exact_match_compares_final_answers(completion: str, answer: Any, reward: float) -> None:
    assert math_exact_match(completion, "a question", {"answer": answer}) == reward


def test_format_rewards_a_marked_final_answer() -> None:
    assert format("so \\boxed{4}", "", {}) == 1.0
    assert format("so\n#### 4", "", {}) == 1.0
    assert format("so 4", "", {}) == 0.0


def raises_on_odd_rows(completion: str, prompt: str, row: dict[str, Any]) -> float:
    if row["n"] % 2:
        raise ArithmeticError(f"row {row['n']} is odd")
    return 1.0


def sample(n: int) -> RewardInput:
    return RewardInput([1, 2], [3, 4], f"prompt {n}", f"completion {n}", {"n": n})


def test_rewards_on_text_and_on_token_ids_run_in_the_pool() -> None:
    assert takes_text(math_exact_match) and not takes_text(lambda prompt, completion: 0.0)
    scorer = Scorer("lockstep_workers.rewards:target_words", RewardErrorAction.FAIL, processes=2)
    try:
        samples = [RewardInput([1], [3, 4, 200, 201], "p", "c", {}) for _ in range(5)]
        assert scorer.scores(samples) == ([0.5] * 5, 0)
    finally:
        scorer.close()
    scorer = Scorer("lockstep_workers.rewards:math_exact_match", RewardErrorAction.FAIL, processes=2)
    try:
        samples = [RewardInput([1], [2], "p", f"#### {n}", {"answer": 3}) for n in (3, 4)]
        assert scorer.scores(samples) == ([1.0, 0.0], 0)
    finally:
        scorer.close()


def test_a_raising_reward_scores_zero_with_zero_and_is_counted_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    scorer = Scorer(f"{__name__}:raises_on_odd_rows", RewardErrorAction.ZERO, processes=2)
    try:
        with caplog.at_level(logging.WARNING, logger="lockstep.trainer"):
            rewards, errors = scorer.scores([sample(n) for n in range(4)])
    finally:
        scorer.close()
    assert (rewards, errors) == ([1.0, 0.0, 1.0, 0.0], 2)
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 2
    assert "{'n': 1}" in logged[0] and "ArithmeticError: row 1 is odd" in logged[0]
    assert "{'n': 3}" in logged[1]


def test_a_raising_reward_stops_the_trainer_with_fail(caplog: pytest.LogCaptureFixture) -> None:
    scorer = Scorer(f"{__name__}:raises_on_odd_rows", RewardErrorAction.FAIL, processes=1)
    try:
        with caplog.at_level(logging.WARNING, logger="lockstep.trainer"), pytest.raises(RewardFailed) as failed:
            scorer.scores([sample(n) for n in range(4)])
    finally:
        scorer.close()
    assert "raised on row {'n': 1}: ArithmeticError: row 1 is odd" in str(failed.value)
    assert "onRewardError: Zero" in str(failed.value)
    assert "{'n': 1}" in caplog.records[0].getMessage()


def test_an_unimportable_reward_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"'lockstep_workers\.rewards:nothing' cannot be imported"):
        Scorer("lockstep_workers.rewards:nothing", RewardErrorAction.ZERO, processes=1)


def nan_on_odd_rows(completion: str, prompt: str, row: dict[str, Any]) -> float:
    return float("nan") if row["n"] % 2 else -math.inf if row["n"] == 2 else 1.0


def test_a_non_finite_reward_is_a_reward_error_under_on_reward_error(caplog: pytest.LogCaptureFixture) -> None:
    """Issue 37 item 1: a NaN reward reached the loss and the trainer's reports unchecked."""
    scorer = Scorer(f"{__name__}:nan_on_odd_rows", RewardErrorAction.ZERO, processes=1)
    try:
        with caplog.at_level(logging.WARNING, logger="lockstep.trainer"):
            rewards, errors = scorer.scores([sample(n) for n in range(4)])
    finally:
        scorer.close()
    assert (rewards, errors) == ([1.0, 0.0, 0.0, 0.0], 3)
    assert "returned nan, not a finite number" in caplog.records[0].getMessage()
    scorer = Scorer(f"{__name__}:nan_on_odd_rows", RewardErrorAction.FAIL, processes=1)
    try:
        with pytest.raises(RewardFailed, match=r"raised on row \{'n': 1\}: ValueError: .* returned nan"):
            scorer.scores([sample(n) for n in range(4)])
    finally:
        scorer.close()
