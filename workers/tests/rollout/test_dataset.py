"""Datasets (spec.trainer.dataset): jsonl, parquet and saved Hugging Face datasets read as the same rows; prompts
rendered through the chat template or as raw text; a missing field or an unreadable file refused, by the trainer
and by ``lockstep validate``, with the file and the field named; each step's rows the same however often the
trainer restarts; the demo's text task as the repository ships it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet
import pytest
import yaml

from lockstep.api import Dataset
from lockstep_workers import text_task
from lockstep_workers.rollout.dataset import DatasetError, PromptDataset, read_rows, step_rows

ROWS = [{"prompt": f"which is larger : {n} or {n + 1} ?", "answer": n + 1, "source": "test"} for n in range(7)]
REPOSITORY = Path(__file__).resolve().parents[3]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_saved_dataset(directory: Path, rows: list[dict[str, Any]]) -> Path:
    """What Hugging Face ``Dataset.save_to_disk`` writes: Arrow stream files, named in state.json."""
    directory.mkdir(parents=True)
    table = pa.Table.from_pylist(rows)
    for name, part in (("data-00000-of-00002.arrow", table.slice(0, 3)), ("data-00001-of-00002.arrow", table[3:])):
        with pa.ipc.new_stream(directory / name, table.schema) as stream:
            stream.write_table(part)
    files = [{"filename": "data-00000-of-00002.arrow"}, {"filename": "data-00001-of-00002.arrow"}]
    (directory / "state.json").write_text(json.dumps({"_data_files": files, "_split": "train"}))
    return directory


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(text_task.create_model(tmp_path_factory.mktemp("model")))


def test_jsonl_parquet_and_saved_datasets_read_as_the_same_rows(tmp_path: Path) -> None:
    spec = Dataset(train="unused", reward_fields=["answer"])
    jsonl = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    parquet = tmp_path / "rows.parquet"
    pyarrow.parquet.write_table(pa.Table.from_pylist(ROWS), parquet)
    saved = write_saved_dataset(tmp_path / "saved" / "train", ROWS)
    (tmp_path / "saved" / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
    for path in (jsonl, parquet, saved):
        assert read_rows(str(path), spec) == ROWS, path
    with pytest.raises(DatasetError, match=r"a DatasetDict with splits train: name one split's directory, e\.g\."):
        read_rows(str(tmp_path / "saved"), spec)


def test_prompts_render_through_the_chat_template_or_as_raw_text(tmp_path: Path, tokenizer: Any) -> None:
    path = str(write_jsonl(tmp_path / "rows.jsonl", ROWS))
    chat = PromptDataset(Dataset(train=path), tokenizer).eval_prompts(None)
    assert chat == []  # no eval split
    first = PromptDataset(Dataset(train=path, shuffle_seed=3), tokenizer).step_prompts(1, 1)[0]
    assert first.text == f"<s>user : {first.row['prompt']} assistant :"
    assert first.token_ids == tokenizer(first.text, add_special_tokens=False)["input_ids"]
    assert first.token_ids[0] == tokenizer.bos_token_id and tokenizer.unk_token_id not in first.token_ids
    raw = PromptDataset(Dataset(train=path, shuffle_seed=3, template="Raw"), tokenizer).step_prompts(1, 1)[0]
    assert raw.row == first.row and raw.text == first.row["prompt"]
    assert raw.token_ids == tokenizer(raw.text)["input_ids"]

    messages = [{"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1 or 2 ?"}]}]
    conversation = str(write_jsonl(tmp_path / "chat.jsonl", messages))
    rendered = PromptDataset(Dataset(train=conversation), tokenizer).step_prompts(1, 1)[0]
    assert rendered.text == "<s>system : be brief user : 1 or 2 ? assistant :"
    with pytest.raises(DatasetError, match=r"holds chat messages, which spec\.trainer\.dataset\.template Raw cannot"):
        PromptDataset(Dataset(train=conversation, template="Raw"), tokenizer)


def test_a_missing_field_or_an_unreadable_file_is_refused_by_name(tmp_path: Path, tokenizer: Any) -> None:
    path = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    with pytest.raises(DatasetError) as missing:
        PromptDataset(Dataset(train=str(path), prompt_field="question"), tokenizer)
    assert str(missing.value).startswith(f"{path}: no field 'question' (spec.trainer.dataset.promptField)")
    assert "'prompt', 'answer', 'source'" in str(missing.value)
    evaluation = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": "1 or 2 ?"}])
    with pytest.raises(DatasetError, match=rf"^{evaluation}: no field 'answer' \(spec.trainer.dataset.rewardFields\)"):
        PromptDataset(Dataset(train=str(path), eval=str(evaluation), reward_fields=["answer"]), tokenizer)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "fine"}\n{"prompt": \n')
    with pytest.raises(DatasetError, match=rf"^{broken}: cannot be read: "):
        read_rows(str(broken), Dataset(train=str(broken)))
    with pytest.raises(DatasetError, match=rf"^{tmp_path / 'rows.csv'}: no such file"):
        read_rows(str(tmp_path / "rows.csv"), Dataset(train="x"))
    numbers = write_jsonl(tmp_path / "numbers.jsonl", [{"prompt": 3}])
    with pytest.raises(DatasetError, match=r"field 'prompt' .* holds int64: expected a string, or chat messages"):
        read_rows(str(numbers), Dataset(train=str(numbers)))


def test_the_steps_take_every_row_once_a_pass_in_an_order_fixed_by_the_seed() -> None:
    rows, per_step = 7, 3
    positions = [n for step in range(1, 8) for n in step_rows(rows, seed=5, step=step, count=per_step)]
    passes = [positions[n : n + rows] for n in range(0, 21, rows)]
    assert all(sorted(one) == list(range(rows)) for one in passes)
    assert passes[0] != passes[1], "each pass is shuffled anew"
    assert step_rows(rows, seed=5, step=4, count=per_step) == positions[9:12], "a step's rows depend on the step"
    assert step_rows(rows, seed=6, step=1, count=rows) != passes[0]


def test_lockstep_validate_refuses_a_dataset_the_trainer_would_refuse(tmp_path: Path) -> None:
    data = tmp_path / "volume" / "data"
    data.mkdir(parents=True)
    write_jsonl(data / "train.jsonl", ROWS)
    write_jsonl(data / "eval.jsonl", [{"prompt": "1 or 2 ?"}])
    job = yaml.safe_load((REPOSITORY / "examples" / "rljob-tiny.yaml").read_text())
    job["spec"]["trainer"]["dataset"] = {"train": "/data/train.jsonl", "rewardFields": ["answer"]}
    manifest = tmp_path / "job.yaml"

    def validate(*options: str) -> subprocess.CompletedProcess[str]:
        manifest.write_text(yaml.safe_dump(job))
        command = [sys.executable, "-m", "lockstep.cli", "validate", str(manifest), *options]
        return subprocess.run(command, capture_output=True, text=True, check=False)

    accepted = validate("--data-root", str(tmp_path / "volume"))
    assert accepted.returncode == 0, accepted.stdout + accepted.stderr
    job["spec"]["trainer"]["dataset"]["eval"] = "/data/eval.jsonl"
    refused = validate("--data-root", str(tmp_path / "volume"))
    assert refused.returncode == 1
    assert f"{data / 'eval.jsonl'}: no field 'answer' (spec.trainer.dataset.rewardFields)" in refused.stdout
    elsewhere = validate()
    assert elsewhere.returncode == 0, "files not on this machine are left to the trainer"
    assert "/data/train.jsonl is not on this machine; the trainer checks it when it starts" in elsewhere.stdout


@pytest.mark.parametrize("task", sorted(text_task.TASKS))
def test_the_repositorys_text_tasks_are_what_their_generator_writes(task: str, tmp_path: Path) -> None:
    shipped = REPOSITORY / "examples" / "datasets" / task
    for written in text_task.write(task, tmp_path):
        assert written.read_text() == (shipped / written.name).read_text(), f"regenerate {shipped}"
    train, held_out = (
        [json.loads(line)["prompt"] for line in (shipped / split).read_text().splitlines()]
        for split in text_task.SPLITS
    )
    assert len(set(train)) == len(train) and not set(train) & set(held_out), "no prompt twice, none in both splits"


def test_the_larger_task_is_said_in_its_tiny_models_words(tokenizer: Any) -> None:
    shipped = REPOSITORY / "examples" / "datasets" / "larger"
    spec = Dataset(train=str(shipped / "train.jsonl"), eval=str(shipped / "eval.jsonl"), reward_fields=["answer"])
    dataset = PromptDataset(spec, tokenizer)
    assert not {row["prompt"] for row in dataset.train} & {row["prompt"] for row in dataset.eval}
    assert all(tokenizer.unk_token_id not in p.token_ids for p in dataset.eval_prompts(None))


def test_evaluation_needs_an_eval_split() -> None:
    from lockstep.cli import schema_errors

    spec = yaml.safe_load((REPOSITORY / "examples" / "rljob-tiny.yaml").read_text())["spec"]
    spec["trainer"]["eval"] = {"everySteps": 5}
    spec["trainer"]["dataset"] = {"train": "/data/train.jsonl"}
    assert schema_errors(spec) == [
        "spec.trainer.eval.everySteps: Invalid value: spec.trainer.eval.everySteps needs spec.trainer.dataset.eval, "
        "the rows to evaluate on: set it, or set everySteps to 0"
    ]
    spec["trainer"]["dataset"]["eval"] = "/data/eval.jsonl"
    assert schema_errors(spec) == []
