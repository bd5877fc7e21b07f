"""Example reward functions for RLJobs (``spec.trainer.args.reward: lockstep_workers.rewards:target_token``).

A reward function takes the prompt's and the completion's token ids and returns a float.
"""

from __future__ import annotations

from lockstep_workers.tiny_model import vocabulary

TARGET_TOKEN = vocabulary(256)["w4"]
"""The token the tiny demo task rewards; a random tiny model starts near 1/256 of it."""


def target_token(prompt: list[int], completion: list[int]) -> float:
    """The fraction of the completion that is the target token: the demo's learnable task."""
    return sum(1 for token in completion if token == TARGET_TOKEN) / max(len(completion), 1)
