"""The verified architecture matrix's pure parts (lockstep_e2e.models_matrix): a family's verdict, its table row,
its record in the JSON file, and the merge of one run into the earlier ones. No engine runs."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from lockstep_e2e.models_matrix import (
    CELL,
    DOCS_BEGIN,
    DOCS_END,
    HEADER,
    NOT_RUN,
    REFUSED_HERE,
    Comparison,
    FamilyResult,
    merged,
    previous_results,
    table_row,
    write_docs,
)
from lockstep_workers.actor.architectures import REFUSED

CHECK = {"modules": 10, "parameters": 5, "unchecked": []}


def verified(name: str = "llama") -> FamilyResult:
    close = Comparison(tokens=320, mean_abs_diff=4e-7, max_abs_diff=2e-6)
    return FamilyResult(
        name,
        "LlamaForCausalLM",
        "untied head",
        361088,
        pre_update=close,
        filesystem=close,
        filesystem_load_check=CHECK,
        gloo=close,
        gloo_load_check=CHECK,
        lora_modules=["q_proj", "v_proj"],
        lora=close,
        seconds=70.0,
    )


def test_a_family_whose_every_check_passed_is_verified() -> None:
    result = verified()
    assert result.failures() == []
    row = table_row(result)
    assert len(row) == len(HEADER)
    assert row[2] == "4.0e-07 (2.0e-06)"
    assert row[-1] == "verified"


def test_a_mismatch_a_failed_check_and_a_check_not_run_are_each_a_failure() -> None:
    result = dataclasses.replace(
        verified(),
        pre_update=Comparison(tokens=320, mean_abs_diff=2e-2, max_abs_diff=0.2),
        gloo_load_check="failed: LoadMismatch: lm_head",
        filesystem_load_check={**CHECK, "unchecked": ["model.layers.0.self_attn.q_proj.bias"]},
        lora=f"{NOT_RUN}: --no-lora",
        seconds=None,
    )
    failures = result.failures()
    assert failures == [
        "pre_update: mean |Δlogprob| 2.00e-02 > 0.0001",
        f"lora: {NOT_RUN}: --no-lora",
        "filesystem_load_check: 1 published tensors unchecked",
        "gloo_load_check: failed: LoadMismatch: lm_head",
    ]
    row = table_row(result)
    assert row[-1] == (
        "FAILED, not refused: add it to architectures.REFUSED "
        "(pre_update, lora, filesystem_load_check, gloo_load_check)"
    )
    assert row[HEADER.index("s")] == NOT_RUN


def test_a_failing_architecture_the_actor_refuses_says_so_and_a_long_error_is_cut_in_the_table(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(REFUSED, "MixtralForCausalLM", "its experts stay stale after an update")
    result = dataclasses.replace(verified(), architecture="MixtralForCausalLM", filesystem="failed: " + "x" * 500)
    row = table_row(result)
    assert row[-1] == "refused (filesystem)"
    assert len(row[HEADER.index("after a filesystem update")]) == CELL
    wrapped = "failed: Exception: Call to collective_rpc method failed: Worker failed with error 'no layers.0.mlp', "
    row = table_row(dataclasses.replace(result, gloo=wrapped + "please check the stack trace above"))
    assert row[HEADER.index("after a gloo update")] == "failed in vLLM's worker: no layers.0.mlp"
    assert table_row(dataclasses.replace(result, filesystem=result.pre_update))[-1] == (
        "verified but refused: take it out of architectures.REFUSED"
    )


def test_a_check_the_actor_refuses_on_this_vllm_build_is_no_failure() -> None:
    """LoRA on a mixture of experts without Triton: the actor refuses it at start, saying why (issue 44); the row
    shows the refusal and the family stays verified. Any other word in that cell is a failure."""
    refused_here = dataclasses.replace(verified(), lora=f"{REFUSED_HERE}: vLLM's LoRA kernels for experts need Triton")
    assert refused_here.failures() == [] and table_row(refused_here)[-1] == "verified"
    assert table_row(dataclasses.replace(refused_here, lora="failed: EngineDeadError"))[-1].startswith("FAILED")


def test_the_json_record_reads_back_and_a_run_replaces_only_its_own_families(tmp_path: Path) -> None:
    out = tmp_path / "models.json"
    earlier = [verified("llama"), dataclasses.replace(verified("qwen2"), gloo="failed: boom")]
    out.write_text(json.dumps({"families": [{**dataclasses.asdict(r), "failures": r.failures()} for r in earlier]}))
    assert previous_results(out) == earlier
    assert previous_results(tmp_path / "absent.json") == []
    latest = [verified("qwen2"), verified("mistral")]
    assert [r.family for r in merged(previous_results(out), latest)] == ["llama", "qwen2", "mistral"]
    assert merged(previous_results(out), latest)[1].gloo == latest[0].gloo


def test_the_table_goes_between_the_markers_and_nowhere_else(tmp_path: Path) -> None:
    meta = {"date": "2026-12-04", "vllm": "0.32.0", "transformers": "5", "torch": "2"}
    docs = tmp_path / "models.md"
    docs.write_text(f"intro\n{DOCS_BEGIN}\nold\n{DOCS_END}\noutro\n")
    assert write_docs(docs, [verified()], meta)
    text = docs.read_text()
    assert text.startswith("intro\n") and text.endswith("outro\n") and "old" not in text
    assert "| llama | LlamaForCausalLM |" in text
    unmarked = tmp_path / "other.md"
    unmarked.write_text("no markers\n")
    assert not write_docs(unmarked, [verified()], meta)
    assert unmarked.read_text() == "no markers\n"
