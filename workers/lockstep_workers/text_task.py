"""The demos' text tasks, as datasets (spec.trainer.dataset) with a train and an eval split, scored by the built-in
lockstep_workers.rewards:math_exact_match:
- ``larger``: which of two digits is larger ("which is larger : 7 or 3 ?" -> 7), for a tiny random model whose
  word-level tokenizer knows the task's words and has a chat template (``create_model``);
- ``addition``: two-digit addition ("What is 37 plus 45? Answer with just the number." -> 82), for a real
  pretrained model and its own chat template (lockstep_e2e.real_model).

``python -m lockstep_workers.text_task TASK DIR`` writes a task's splits (examples/datasets/TASK/ holds them).
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
"""Pairs held out of training, to evaluate on (the larger task)."""
ADDITION_ROWS = (400, 40)
"""The addition task's train and eval rows."""
SPLITS = ("train.jsonl", "eval.jsonl")
Rows = list[dict[str, Any]]


def larger() -> tuple[Rows, Rows]:
    """The train and eval rows: every pair of different digits once, shuffled, the eval rows held out."""
    pairs = [(a, b) for a in range(10) for b in range(10) if a != b]
    random.Random(0).shuffle(pairs)
    every = [{"prompt": f"which is larger : {a} or {b} ?", "answer": max(a, b)} for a, b in pairs]
    return every[EVAL_ROWS:], every[:EVAL_ROWS]


def addition() -> tuple[Rows, Rows]:
    """The train and eval rows: distinct pairs of two-digit numbers, drawn with a fixed seed, none in both splits."""
    train, held_out = ADDITION_ROWS
    pairs = random.Random(0).sample([(a, b) for a in range(10, 100) for b in range(10, 100)], train + held_out)
    every = [{"prompt": f"What is {a} plus {b}? Answer with just the number.", "answer": a + b} for a, b in pairs]
    return every[held_out:], every[:held_out]


TASKS = {"larger": larger, "addition": addition}


def write(task: str, directory: Path) -> list[Path]:
    """Write ``task``'s splits as jsonl files in ``directory``; return their paths (train, eval)."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / name for name in SPLITS]
    for path, split in zip(paths, TASKS[task](), strict=True):
        path.write_text("".join(json.dumps(row) + "\n" for row in split))
    return paths


def create_model(directory: Path) -> Path:
    """A tiny random Llama for the task: its tokenizer knows the task's words and has a chat template."""
    return create_tiny_llama(directory, vocab_size=VOCABULARY_SIZE, words=WORDS, chat_template=CHAT_TEMPLATE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("task", choices=sorted(TASKS))
    parser.add_argument("directory", type=Path)
    options = parser.parse_args()
    for path in write(options.task, options.directory):
        print(path)


if __name__ == "__main__":
    main()
