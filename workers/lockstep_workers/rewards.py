"""The demo task for RLJobs: prompts of random words, and a reward for one target word.

``spec.trainer.reward: lockstep_workers.rewards:target_token`` and
``spec.trainer.prompts: lockstep_workers.rewards:random_prompts``. A reward function takes the
prompt's and the completion's token ids and returns a float; a prompt source takes the step, a
count and a seed and returns that many prompts (token id lists).
"""

from __future__ import annotations

import random

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
