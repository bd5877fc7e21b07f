"""An RLJob's dataset (spec.trainer.dataset): its rows, read with pyarrow from a .jsonl or .parquet file or a
directory a Hugging Face dataset was saved to; checked for the fields the job names; shuffled deterministically;
and each step's prompts, rendered with the model tokenizer's chat template or as raw text.

Step N (from 1) takes the rows at positions (N - 1) * promptsPerStep onwards of an endless sequence of passes
over the training rows, each pass shuffled by (shuffleSeed, pass): the position is a function of the step, which
the trainer's checkpoint and published weights record, so a resumed trainer goes on at the same row.
"""

from __future__ import annotations

import functools
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from lockstep.api import Dataset, PromptTemplate

Row = dict[str, Any]

SAVED_DATASET_STATE = "state.json"
"""What Hugging Face ``Dataset.save_to_disk`` writes beside its Arrow files: their names, in order."""
SAVED_DATASET_DICT = "dataset_dict.json"
"""What ``DatasetDict.save_to_disk`` writes: the splits, each a saved dataset in its own subdirectory."""


class DatasetError(ValueError):
    """A dataset the trainer cannot use; the message names the file and the field."""


class Tokenizer(Protocol):
    """What the dataset asks of the model's (Hugging Face) tokenizer."""

    chat_template: str | None

    def apply_chat_template(self, conversation: list[dict[str, Any]], **options: Any) -> Any: ...

    def __call__(self, text: str, **options: Any) -> Any: ...


@dataclass(frozen=True)
class Prompt:
    """One prompt for the actors, and what the reward sees of it."""

    token_ids: list[int]
    text: str
    row: Row


def read_rows(path: str, spec: Dataset) -> list[Row]:
    """The rows at ``path`` (spec.trainer.dataset.train or .eval), checked: readable, not empty, with the prompt
    field (a string, or chat messages with Chat) and every reward field. Raises DatasetError naming the file and
    the field."""
    import pyarrow as pa

    table = _read_table(Path(path))
    for field, setting in ((spec.prompt_field, "promptField"), *((f, "rewardFields") for f in spec.reward_fields)):
        if field not in table.column_names:
            raise DatasetError(
                f"{path}: no field {field!r} (spec.trainer.dataset.{setting}); its rows have "
                f"{', '.join(map(repr, table.column_names))}: name one of them, or fix the file"
            )
    if table.num_rows == 0:
        raise DatasetError(f"{path}: no rows")
    prompt = table.schema.field(spec.prompt_field).type
    messages = pa.types.is_list(prompt) and pa.types.is_struct(prompt.value_type)
    if not (pa.types.is_string(prompt) or pa.types.is_large_string(prompt) or messages):
        raise DatasetError(
            f"{path}: field {spec.prompt_field!r} (spec.trainer.dataset.promptField) holds {prompt}: expected a "
            "string, or chat messages (a list of {role, content})"
        )
    if messages and spec.template is PromptTemplate.RAW:
        raise DatasetError(
            f"{path}: field {spec.prompt_field!r} (spec.trainer.dataset.promptField) holds chat messages, which "
            "spec.trainer.dataset.template Raw cannot render: set template Chat"
        )
    rows: list[Row] = table.to_pylist()
    return rows


def _read_table(path: Path) -> Any:
    """A pyarrow Table of the file or saved dataset at ``path``."""
    import pyarrow as pa
    import pyarrow.json
    import pyarrow.parquet

    try:
        if path.is_dir():
            return _saved_dataset(path)
        if path.suffix == ".parquet":
            return pyarrow.parquet.read_table(path)
        if path.suffix in (".jsonl", ".json"):
            return pyarrow.json.read_json(path)
    except (OSError, pa.ArrowException, ValueError, KeyError) as error:
        raise DatasetError(f"{path}: cannot be read: {error}") from error
    if not path.exists():
        raise DatasetError(f"{path}: no such file or directory")
    raise DatasetError(
        f"{path}: not a dataset the trainer reads: name a .jsonl or .parquet file, or a directory a Hugging Face "
        "dataset was saved to (save_to_disk)"
    )


def _saved_dataset(directory: Path) -> Any:
    """The rows of a Hugging Face dataset saved to ``directory``: its Arrow stream files, in order."""
    import pyarrow as pa

    state = directory / SAVED_DATASET_STATE
    if not state.exists():
        splits = directory / SAVED_DATASET_DICT
        if splits.exists():
            names = json.loads(splits.read_text())["splits"]
            raise DatasetError(
                f"{directory}: a DatasetDict with splits {', '.join(names)}: name one split's directory, e.g. "
                f"{directory / names[0]}"
            )
        raise DatasetError(f"{directory}: a directory without {SAVED_DATASET_STATE}: not a saved Hugging Face dataset")
    files = [directory / entry["filename"] for entry in json.loads(state.read_text())["_data_files"]]
    return pa.concat_tables([pa.ipc.open_stream(file).read_all() for file in files])


def render(row: Row, spec: Dataset, tokenizer: Tokenizer) -> Prompt:
    """The prompt of ``row`` as the actors get it: through the chat template (with the generation prompt; a
    string is one user message) or as raw text (the tokenizer adds its special tokens, such as <s>)."""
    value = row[spec.prompt_field]
    if spec.template is PromptTemplate.CHAT:
        messages = [{"role": "user", "content": value}] if isinstance(value, str) else value
        text: str = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        token_ids: list[int] = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        text = value
        token_ids = tokenizer(text)["input_ids"]
    return Prompt(list(token_ids), text, row)


@functools.lru_cache(maxsize=4)
def pass_order(rows: int, seed: int, number: int) -> tuple[int, ...]:
    """The order of the training rows in pass ``number`` (from 0) over them."""
    order = list(range(rows))
    random.Random(f"{seed}/{number}").shuffle(order)
    return tuple(order)


def step_rows(rows: int, seed: int, step: int, count: int) -> list[int]:
    """The indices of the ``count`` training rows that step ``step`` (from 1) takes."""
    start = (step - 1) * count
    return [pass_order(rows, seed, position // rows)[position % rows] for position in range(start, start + count)]


class PromptDataset:
    """The job's dataset in the trainer (rank 0): the training rows each step takes, and the eval rows."""

    def __init__(self, spec: Dataset, tokenizer: Tokenizer) -> None:
        if spec.template is PromptTemplate.CHAT and not tokenizer.chat_template:
            raise DatasetError(
                "spec.trainer.dataset.template is Chat, but the model's tokenizer has no chat template: give the "
                "model one (chat_template in tokenizer_config.json), or set template Raw"
            )
        self.spec = spec
        self.tokenizer = tokenizer
        self.train = read_rows(spec.train, spec)
        self.eval = read_rows(spec.eval, spec) if spec.eval else []

    def step_prompts(self, step: int, count: int) -> list[Prompt]:
        """The prompts of step ``step``: the same for the same step, however often the trainer restarted."""
        indices = step_rows(len(self.train), self.spec.shuffle_seed, step, count)
        return [render(self.train[n], self.spec, self.tokenizer) for n in indices]

    def eval_prompts(self, limit: int | None) -> list[Prompt]:
        """The first ``limit`` (default: all) eval rows' prompts."""
        return [render(row, self.spec, self.tokenizer) for row in self.eval[:limit]]
