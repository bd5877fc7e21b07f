"""Reward functions (spec.trainer.reward) and a prompt source (spec.trainer.prompts).

- On text: ``math_exact_match`` and ``format``, called as reward(completion, prompt, row): the decoded
  completion, the prompt's text and its dataset row (spec.trainer.dataset).
- On token ids: the first demo task, ``target_words`` with the prompt source ``random_prompts``: a reward
  takes the prompt's and the completion's token ids; a prompt source takes the step, a count and a seed and
  returns that many prompts (token id lists).

Each returns a float.
"""

from __future__ import annotations

import random
import re
from decimal import Decimal
from typing import Any

from lockstep_workers.tiny_model import SPECIAL_TOKENS, vocabulary

WORDS = vocabulary(256)
TARGET_WORDS = frozenset(WORDS[f"w{i}"] for i in range(32))
"""The words the demo task rewards: an eighth of the vocabulary, so a random model starts near 0.125."""


def target_words(prompt: list[int], completion: list[int]) -> float:
    """The fraction of the completion that is one of the target words: the demo's learnable task."""
    return sum(1 for token in completion if token in TARGET_WORDS) / max(len(completion), 1)


def random_prompts(step: int, count: int, seed: int, length: int = 3) -> list[list[int]]:
    """``count`` prompts of ``length`` random words after <s>, the same for the same (step, seed)."""
    rng = random.Random(seed * 1_000_003 + step)
    words = range(len(SPECIAL_TOKENS), len(WORDS))
    return [[WORDS["<s>"], *rng.choices(words, k=length)] for _ in range(count)]


# -- rewards on text: reward(completion, prompt, row) --------------------------------------------------------------

BOXED = "\\boxed{"
HASHES = re.compile(r"####\s*([^\n]*)")
MINUS_SIGN = "\u2212"
NUMBER = re.compile(r"(?<!\w)" + f"[-{MINUS_SIGN}]?" + r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?!\w)")
"""A number: an optional minus sign, digits (perhaps in thousands), an optional fraction; not part of a word
(``x2``, ``3rd``)."""


def _boxed(text: str) -> str | None:
    """The contents of the last ``\\boxed{...}`` in ``text`` (braces may nest), if any."""
    start = text.rfind(BOXED)
    if start < 0:
        return None
    depth, position = 1, start + len(BOXED)
    for end in range(position, len(text)):
        depth += {"{": 1, "}": -1}.get(text[end], 0)
        if depth == 0:
            return text[position:end]
    return None


def final_answer(text: str) -> str | None:
    """The final answer ``text`` gives, normalised: from its last ``\\boxed{}``, else its last ``####`` line,
    else its last number; None when it gives none."""
    answer = _boxed(text)
    if answer is None and (hashes := HASHES.findall(text)):
        answer = hashes[-1]
    if answer is None and (numbers := NUMBER.findall(text)):
        answer = numbers[-1]
    return None if answer is None else normalise(answer)


def normalise(answer: str) -> str:
    """A number as one spelling (``-1,234.50`` and ``\u22121234.5`` are ``-1234.5``; ``7.0`` is ``7``); any other
    answer with its spaces and surrounding ``$`` removed."""
    text = answer.strip().strip("$").strip().rstrip(".").replace(MINUS_SIGN, "-")
    if NUMBER.fullmatch(text):
        return f"{Decimal(text.replace(',', '')).normalize():f}"
    return "".join(text.split())


def math_exact_match(completion: str, prompt: str, row: dict[str, Any]) -> float:
    """1.0 when the completion's final answer equals the row's ``answer`` (its final answer too, so a GSM8K
    solution ending in ``#### 72`` serves), else 0.0. Raises KeyError for a row without ``answer``."""
    given = final_answer(completion)
    return float(given is not None and given == final_answer(str(row["answer"])))


def format(completion: str, prompt: str, row: dict[str, Any]) -> float:
    """1.0 when the completion marks a final answer (``\\boxed{...}`` or a ``####`` line), else 0.0."""
    return float(_boxed(completion) is not None or HASHES.search(completion) is not None)
