"""Rewards: the built-in text rewards find the final answer in its usual spellings; the process pool runs rewards on
text and on token ids; a reward that raises is counted, logged with its row, and scored by onRewardError."""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lockstep.api import RewardErrorAction, Training, WeightedReward
from lockstep_workers.rewards import final_answer, format, math_exact_match
from lockstep_workers.rollout.scoring import RewardFailed, RewardInput, Scorer, Scores, takes_text, weighted_sum


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


def one(reference: str) -> list[WeightedReward]:
    """spec.trainer.reward as the trainer scores it: the one function, of weight 1."""
    return Training(reward=reference).reward_functions()


def sample(n: int) -> RewardInput:
    return RewardInput([1, 2], [3, 4], f"prompt {n}", f"completion {n}", {"n": n})


def test_rewards_on_text_and_on_token_ids_run_in_the_pool() -> None:
    assert takes_text(math_exact_match) and not takes_text(lambda prompt, completion: 0.0)
    scorer = Scorer(one("lockstep_workers.rewards:target_words"), RewardErrorAction.FAIL, processes=2)
    try:
        samples = [RewardInput([1], [3, 4, 200, 201], "p", "c", {}) for _ in range(5)]
        assert scorer.scores(samples) == Scores([0.5] * 5, {"reward": [0.5] * 5}, 0)
    finally:
        scorer.close()
    scorer = Scorer(one("lockstep_workers.rewards:math_exact_match"), RewardErrorAction.FAIL, processes=2)
    try:
        samples = [RewardInput([1], [2], "p", f"#### {n}", {"answer": 3}) for n in (3, 4)]
        assert scorer.scores(samples).rewards == [1.0, 0.0]
    finally:
        scorer.close()


def test_a_raising_reward_scores_zero_with_zero_and_is_counted_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    scorer = Scorer(one(f"{__name__}:raises_on_odd_rows"), RewardErrorAction.ZERO, processes=2)
    try:
        with caplog.at_level(logging.WARNING, logger="lockstep.trainer"):
            scores = scorer.scores([sample(n) for n in range(4)])
    finally:
        scorer.close()
    assert (scores.rewards, scores.errors) == ([1.0, 0.0, 1.0, 0.0], 2)
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 2
    assert "{'n': 1}" in logged[0] and "ArithmeticError: row 1 is odd" in logged[0]
    assert "{'n': 3}" in logged[1]


def test_a_raising_reward_stops_the_trainer_with_fail(caplog: pytest.LogCaptureFixture) -> None:
    scorer = Scorer(one(f"{__name__}:raises_on_odd_rows"), RewardErrorAction.FAIL, processes=1)
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
        Scorer(one("lockstep_workers.rewards:nothing"), RewardErrorAction.ZERO, processes=1)


def nan_on_odd_rows(completion: str, prompt: str, row: dict[str, Any]) -> float:
    return float("nan") if row["n"] % 2 else -math.inf if row["n"] == 2 else 1.0


def test_a_non_finite_reward_is_a_reward_error_under_on_reward_error(caplog: pytest.LogCaptureFixture) -> None:
    """Issue 37 item 1: a NaN reward reached the loss and the trainer's reports unchecked."""
    scorer = Scorer(one(f"{__name__}:nan_on_odd_rows"), RewardErrorAction.ZERO, processes=1)
    try:
        with caplog.at_level(logging.WARNING, logger="lockstep.trainer"):
            scores = scorer.scores([sample(n) for n in range(4)])
    finally:
        scorer.close()
    assert (scores.rewards, scores.errors) == ([1.0, 0.0, 0.0, 0.0], 3)
    assert "returned nan, not a finite number" in caplog.records[0].getMessage()
    scorer = Scorer(one(f"{__name__}:nan_on_odd_rows"), RewardErrorAction.FAIL, processes=1)
    try:
        with pytest.raises(RewardFailed, match=r"raised on row \{'n': 1\}: ValueError: .* returned nan"):
            scorer.scores([sample(n) for n in range(4)])
    finally:
        scorer.close()


def huge(completion: str, prompt: str, row: dict[str, Any]) -> float:
    return 1e306 if row["n"] else 1.0


@pytest.mark.parametrize("action", list(RewardErrorAction))
def test_a_weighted_sum_that_overflows_is_a_reward_error_naming_the_function(
    action: RewardErrorAction, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 46 item 5: each reward finite, their weighted sum inf: it reached the loss, caught there only as a
    non-finite loss. Now it is scored as onRewardError says, naming the function whose weighted reward is largest."""
    functions = [
        WeightedReward(name="correct", function="lockstep_workers.rewards:math_exact_match"),
        WeightedReward(name="huge", function=f"{__name__}:huge", weight=1000.0),
    ]
    samples = [RewardInput([1], [2], "p", "#### 3", {"answer": 3, "n": n}) for n in range(2)]
    scorer = Scorer(functions, action, processes=1)
    try:
        if action is RewardErrorAction.FAIL:
            with pytest.raises(RewardFailed, match=rf"{__name__}:huge raised on row .*'n': 1.*weighted sum of the "):
                scorer.scores(samples)
            return
        with caplog.at_level(logging.WARNING, logger="lockstep.trainer"):
            scores = scorer.scores(samples)
    finally:
        scorer.close()
    assert (scores.rewards, scores.errors) == ([1001.0, 0.0], 1)
    assert scores.parts == {"correct": [1.0, 1.0], "huge": [1.0, 1e306]}, "each function's own reward, kept"
    said = caplog.records[0].getMessage()
    assert (
        f"{__name__}:huge" in said and "the weighted sum of the rewards is inf: this function returned 1e+306" in said
    )


def test_several_reward_functions_score_their_weighted_sum_and_each_its_own_part() -> None:
    functions = [
        WeightedReward(name="correct", function="lockstep_workers.rewards:math_exact_match"),
        WeightedReward(name="format", function="lockstep_workers.rewards:format", weight=0.1),
        WeightedReward(name="odd", function=f"{__name__}:raises_on_odd_rows", weight=-2.0),
    ]
    scorer = Scorer(functions, RewardErrorAction.ZERO, processes=2)
    try:
        samples = [RewardInput([1], [2], "p", text, {"answer": 3, "n": n}) for n, text in enumerate(["#### 3", "3"])]
        scores = scorer.scores(samples)
    finally:
        scorer.close()
    assert scores.parts == {"correct": [1.0, 1.0], "format": [1.0, 0.0], "odd": [1.0, 0.0]}
    assert scores.rewards == pytest.approx([1.0 + 0.1 - 2.0, 1.0]) and scores.errors == 1


@given(st.lists(st.tuples(st.floats(-10, 10), st.lists(st.floats(-10, 10), min_size=3, max_size=3)), max_size=5))
def test_the_weighted_sum_is_each_samples_dot_product_of_weights_and_rewards(
    functions: list[tuple[float, list[float]]],
) -> None:
    weights = [weight for weight, _ in functions]
    parts = [rewards for _, rewards in functions]
    expected = [sum(w * rewards[n] for w, rewards in functions) for n in range(3)] if functions else []
    assert weighted_sum(parts, weights) == pytest.approx(expected)
