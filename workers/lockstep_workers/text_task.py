"""The demo's text task: which of two digits is larger ("which is larger : 7 or 3 ?" -> 7), as a dataset
(spec.trainer.dataset) with a train and an eval split, and a tiny random model whose word-level tokenizer knows the
task's words and has a chat template. The reward is the built-in lockstep_workers.rewards:math_exact_match.

``python -m lockstep_workers.text_task DIR`` writes the splits (examples/datasets/larger/ holds them).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

from lockstep_workers.tiny_model import CHAT_TEMPLATE, CHAT_WORDS, create_tiny_llama

DIGITS = tuple(str(n) for n in range(10))
WORDS = (*CHAT_WORDS, "which", "is", "larger", "or", "?", *DIGITS)
"""Every word of the task's prompts and answers."""
VOCABULARY_SIZE = 48
"""The tiny model's vocabulary: the task's words and unused ones. Small, so that a random model says a digit now
and then and the reward has something to reinforce."""
EVAL_ROWS = 20
"""Pairs held out of training, to evaluate on."""
SPLITS = ("train.jsonl", "eval.jsonl")


def rows() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The train and eval rows: every pair of different digits once, shuffled, the eval rows held out."""
    pairs = [(a, b) for a in range(10) for b in range(10) if a != b]
    random.Random(0).shuffle(pairs)
    every = [{"prompt": f"which is larger : {a} or {b} ?", "answer": max(a, b)} for a, b in pairs]
    return every[EVAL_ROWS:], every[:EVAL_ROWS]


def write(directory: Path) -> list[Path]:
    """Write the splits as jsonl files in ``directory``; return their paths (train, eval)."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / name for name in SPLITS]
    for path, split in zip(paths, rows(), strict=True):
        path.write_text("".join(json.dumps(row) + "\n" for row in split))
    return paths


def create_model(directory: Path) -> Path:
    """A tiny random Llama for the task: its tokenizer knows the task's words and has a chat template."""
    return create_tiny_llama(directory, vocab_size=VOCABULARY_SIZE, words=WORDS, chat_template=CHAT_TEMPLATE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("directory", type=Path)
    for path in write(parser.parse_args().directory):
        print(path)


if __name__ == "__main__":
    main()
