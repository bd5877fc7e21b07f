"""The job's vLLM settings mapped onto the vLLM that runs them: applied, satisfied by construction (the behaviour
they turn off is gone from vLLM), or refused (vLLM cannot honour them) — read from the installed vLLM, and from
descriptions of a vLLM that dropped or never had an argument."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from lockstep.api import VllmSettings
from lockstep.parity import default_policy
from lockstep_workers.actor.vllm_args import EngineArgsDescription, UnsupportedSetting, installed_vllm, map_settings

LOCKED = default_policy().spec.vllm
APPLIED = {
    "logprobs_mode": "processed_logprobs",
    "enable_prefix_caching": False,
    "async_scheduling": False,
    "hf_overrides": {"head_dtype": "float32"},
}
"""The default policy's settings as every vLLM here applies them: all but disableCascadeAttn."""


def test_on_the_installed_vllm_cascade_attention_is_satisfied_by_construction() -> None:
    vllm = installed_vllm()
    assert vllm.version.startswith("0.32.")
    assert "disable_cascade_attn" in vllm.arguments and "no effect" in vllm.deprecated["disable_cascade_attn"]

    applied = map_settings(LOCKED, vllm)
    assert applied.engine_args == APPLIED, "disableCascadeAttn is not passed: vLLM deprecated it and would warn"
    reason = applied.satisfied_by_construction["disableCascadeAttn"]
    assert "vLLM 0.32" in reason and "no longer has cascade attention" in reason and "deprecated" in reason
    assert applied.report()["satisfiedByConstruction"] == ["disableCascadeAttn"]

    with pytest.raises(
        UnsupportedSetting, match=r"disableCascadeAttn=false asks for cascade attention, but vLLM 0\.32"
    ):
        map_settings(VllmSettings(disable_cascade_attn=False), vllm)


def without(vllm: EngineArgsDescription, argument: str) -> EngineArgsDescription:
    """``vllm`` as a release that dropped ``argument`` altogether."""
    return dataclasses.replace(
        vllm,
        version="0.33.0",
        arguments=vllm.arguments - {argument},
        deprecated={name: note for name, note in vllm.deprecated.items() if name != argument},
    )


def test_once_vllm_drops_the_flag_it_still_holds_by_construction_and_is_not_passed() -> None:
    later = without(installed_vllm(), "disable_cascade_attn")
    applied = map_settings(LOCKED, later)
    assert applied.engine_args == APPLIED
    assert applied.satisfied_by_construction == {
        "disableCascadeAttn": "vLLM 0.33.0 no longer has cascade attention (it has no engine argument "
        "disable_cascade_attn)"
    }


def test_a_setting_vllm_does_not_know_or_a_value_it_does_not_accept_is_refused() -> None:
    later = without(installed_vllm(), "async_scheduling")
    with pytest.raises(UnsupportedSetting) as refused:
        map_settings(LOCKED, later)
    assert "asyncScheduling=false: vLLM 0.33.0 has no engine argument async_scheduling" in str(refused.value)

    narrower = dataclasses.replace(installed_vllm(), choices={"logprobs_mode": frozenset({"raw_logprobs"})})
    with pytest.raises(UnsupportedSetting, match=r"logprobsMode=processed_logprobs: vLLM 0.32.\d+ accepts only raw_"):
        map_settings(LOCKED, narrower)


def test_the_actor_refuses_to_start_on_a_setting_its_vllm_cannot_honour(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "lockstep_workers.actor", f"--model={tmp_path}", "--no-disable-cascade-attn"],
        capture_output=True,
        text=True,
        timeout=240,  # within pytest's 300 s, so that a hung start fails here with its stderr
    )
    assert run.returncode == 1, run.stderr[-3000:]
    assert "the actor does not start" in run.stderr and "disableCascadeAttn=false asks for cascade" in run.stderr
