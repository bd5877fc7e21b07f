"""`lockstep parity-check` on a tiny peaky bf16 Llama shows each of the four fixes, the stale-KV trap and
what is left for truncated importance sampling; the locked configuration comes out closest. With a LoRA adapter
(a LoRA job), vLLM's LoRA kernels stay within the default budget of PEFT's forward (the same run's LoRA row), and the
preflight measures a LoRA job with its adapter."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lockstep import environment
from lockstep.api import DType, LoraSettings, MismatchBudget, PauseMode, VllmSettings, WeightUpdateSemantics
from lockstep.parity import default_policy
from lockstep.podconfig import PodConfig
from lockstep_workers import parity_check
from lockstep_workers.parity_check import Configuration, Measurement, Workload, configurations, job_configuration


def pod_config(lora: LoraSettings | None) -> PodConfig:
    """A job's PodConfig under the default policy, a LoRA job's with ``lora``."""
    policy = default_policy().spec
    return PodConfig.model_validate(
        {
            "fingerprint": "0" * 64,
            "policy": "default",
            "model": {"uri": "/models/tiny"},
            "vllm": policy.vllm.model_dump(mode="json", by_alias=True, exclude_none=True),
            "trainer": {"lmHeadDtype": policy.trainer.lm_head_dtype.value},
            "weightUpdate": policy.weight_update.model_dump(mode="json", by_alias=True),
            "mismatchBudget": {},
            "training": {
                "reward": "lockstep_workers.rewards:target_words",
                **({"lora": lora.model_dump(mode="json", by_alias=True)} if lora else {}),
            },
        }
    )


def test_the_parity_check_lists_the_locked_policy_with_a_rank_16_lora_adapter() -> None:
    listed = configurations(default_policy(), VllmSettings(dtype=DType.BFLOAT16))
    [with_lora] = [c for c in listed if c.lora is not None]
    locked = next(c for c in listed if c.name.startswith("locked (") and c.lora is None)
    assert with_lora.name == f"{locked.name} + LoRA r16" and with_lora.lora == LoraSettings(rank=16)
    assert with_lora.lora.target_modules is None, "the default target modules: every linear module of the layers"
    assert (with_lora.vllm, with_lora.fp32_head, with_lora.update) == (locked.vllm, locked.fp32_head, locked.update)


def test_a_lora_jobs_configuration_carries_its_adapter_settings() -> None:
    lora = LoraSettings(rank=8, alpha=16, target_modules=["q_proj", "v_proj"])
    assert job_configuration(pod_config(lora)).lora == lora
    assert job_configuration(pod_config(None)).lora is None


def test_the_preflight_of_a_lora_job_measures_with_its_adapter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lora = LoraSettings(rank=32)
    (tmp_path / "config.json").write_text(pod_config(lora).text())
    measured: list[Configuration] = []
    patched: list[dict[str, Any]] = []

    def measure(chosen: list[Configuration], *_: Any) -> list[Measurement]:
        measured.extend(chosen)
        metrics = {"meanAbsDiff": 0.01, "clipFraction": 0.0, "outsideTopP": 0.0, "tokens": 10.0, "maxAbsDiff": 0.1}
        return [Measurement(chosen[0], {name: metrics for name in ("batch", "topP", "sharedPrefix")})]

    class Pods:
        def patch_namespaced_pod(self, name: str, namespace: str, body: dict[str, Any]) -> None:
            patched.append(body)

    monkeypatch.setattr(parity_check, "measure", measure)
    monkeypatch.setattr("lockstep_workers.agent.pod_agent.pod_api", Pods)
    environ = {
        environment.CONFIG: str(tmp_path / "config.json"),
        environment.POD_NAME: "demo-preflight-0",
        environment.POD_NAMESPACE: "team-a",
    }
    assert parity_check.preflight(tmp_path / "model", Workload(), environ) == 0
    [configuration] = measured
    assert configuration.lora == lora and "LoRA r32" in configuration.name
    assert len(patched) == 1


def test_a_random_adapter_is_non_zero_on_every_linear_module_of_the_layers(tmp_path: Path) -> None:
    import json

    from lockstep_workers.tiny_model import create_tiny_llama
    from lockstep_workers.weights.lora import ADAPTER_CONFIG_METADATA

    model = create_tiny_llama(tmp_path / "model")
    tensors, metadata = parity_check.random_adapter(model, LoraSettings(), seed=1)
    config = json.loads(metadata[ADAPTER_CONFIG_METADATA])
    modules = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert config["target_modules"] == modules and config["r"] == 16
    assert len(tensors) == 2 * 2 * len(modules), "lora_A and lora_B of each module of the 2 layers"
    assert all(t.abs().max() > 0 for t in tensors.values()), "lora_B is not PEFT's zeros: the adapter acts"
    again, _ = parity_check.random_adapter(model, LoraSettings(), seed=1)
    assert all(again[n].equal(t) for n, t in tensors.items()), "seeded"


LADDER = ["vLLM V1 defaults", "+ processed logprobs", "+ explicit runtime defaults", "+ pause keep, clear_cache=False"]


def test_the_parity_check_adds_each_fix_on_top_of_the_ones_before_and_ends_on_the_locked_policy() -> None:
    """The configurations of the documented table (docs/parity.md), in order: each rung of the ladder changes only
    its fix, the last rung ("+ fp32 lm_head") is the default policy's settings (so its row ties the locked one), and
    the refused, fp32 and LoRA rows vary the locked configuration alone."""
    policy = default_policy()
    listed = configurations(policy, VllmSettings(dtype=DType.BFLOAT16))
    by_name = {c.name: c for c in listed}
    assert [c.name for c in listed] == [
        *LADDER,
        "+ fp32 lm_head",
        "locked (default)",
        "locked + prefix caching",
        "locked (default), fp32 model",
        "locked (default) + LoRA r16",
    ]
    fixes = {
        "+ processed logprobs": {"logprobs_mode"},
        "+ explicit runtime defaults": {"enable_prefix_caching", "async_scheduling", "disable_cascade_attn"},
        "+ pause keep, clear_cache=False": set(),
        "+ fp32 lm_head": {"hf_overrides"},
    }
    for earlier, later in itertools.pairwise([*LADDER, "+ fp32 lm_head"]):
        before, after = by_name[earlier].vllm.model_dump(), by_name[later].vllm.model_dump()
        assert {key for key in after if after[key] != before[key]} == fixes[later], later
    assert by_name["vLLM V1 defaults"].update == WeightUpdateSemantics(pause_mode=PauseMode.ABORT, clear_cache=True)
    assert by_name["+ pause keep, clear_cache=False"].update == WeightUpdateSemantics(
        pause_mode=PauseMode.KEEP, clear_cache=False
    )
    assert not any(by_name[name].fp32_head for name in LADDER) and by_name["+ fp32 lm_head"].fp32_head
    top, locked = by_name["+ fp32 lm_head"], by_name["locked (default)"]
    assert (top.vllm, top.fp32_head, top.update) == (locked.vllm, locked.fp32_head, locked.update)
    stale = by_name["locked + prefix caching"]
    assert stale.vllm == locked.vllm.model_copy(update={"enable_prefix_caching": True}) and stale.refused
    assert by_name["locked (default), fp32 model"].vllm == locked.vllm.model_copy(update={"dtype": DType.FLOAT32})


def test_an_only_that_names_no_configuration_stops_the_parity_check_before_any_engine(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stopped:
        parity_check.main(["--out", str(tmp_path), "--only", "locked", "--only", "+ fp16 lm_head"])
    assert stopped.value.code == 2
    error = capsys.readouterr().err
    assert "--only ['+ fp16 lm_head']: no configuration's name contains it" in error and "'+ fp32 lm_head'" in error
    assert not any(tmp_path.iterdir()), "no model made, nothing measured"


MEASURED = ["vLLM V1 defaults", "+ processed logprobs", "locked"]
"""What the CLI's test runs (``--only``, by name): the defaults, the first fix, and every locked row (the locked
configuration, the refused prefix caching, fp32 on both sides, a LoRA adapter). The other three rungs of the ladder
are the benchmark's (docs/parity.md's table, ``lockstep parity-check`` with no ``--only``): on a single batch they
equal the row before them, and the last one's settings are the locked configuration's (the test above)."""


@pytest.mark.vllm
@pytest.mark.timeout(900)  # six engine starts: about 6 minutes with the 2 cores shared by other work (load 6-7)
def test_parity_check_reproduces_the_fixes_and_ranks_the_locked_policy_closest(tmp_path: Path) -> None:
    """Six configurations, each an engine of its own, on the default workload (the documented table's): raw
    logprobs the largest gap, the stale-KV trap, the locked configuration closest, fp32 leaving numerics alone; with a
    rank-16 adapter, vLLM's LoRA kernels within the default budget of PEFT's forward on batch and topP under adapter
    1 and the shared prefix after an in-flight update to adapter 2, the adapters moving the trainer's logprobs far
    more than vLLM's are from them."""
    chosen = [argument for text in MEASURED for argument in ("--only", text)]
    run = subprocess.run(
        [str(Path(sys.executable).with_name("lockstep")), "parity-check", "--out", str(tmp_path), *chosen],
        capture_output=True,
        text=True,
        timeout=840,
    )
    causes = [line for line in run.stderr.splitlines() if "Error" in line or "error" in line]
    assert run.returncode == 0, "\n".join(causes[-15:]) or run.stderr[-3000:]
    assert "train-inference mismatch" in run.stdout and (tmp_path / "parity.png").stat().st_size > 0
    results = {c["name"]: c for c in json.loads((tmp_path / "parity.json").read_text())["configurations"]}
    locked = "locked (default)"
    assert list(results) == [
        "vLLM V1 defaults",
        "+ processed logprobs",
        locked,
        "locked + prefix caching",
        f"{locked}, fp32 model",
        f"{locked} + LoRA r16",
    ]
    batch = {name: c["batch"] for name, c in results.items()}
    raw, processed = batch["vLLM V1 defaults"], batch["+ processed logprobs"]
    assert raw["meanAbsDiff"] - processed["meanAbsDiff"] > processed["meanAbsDiff"] - batch[locked]["meanAbsDiff"], (
        "raw vs processed is the largest gap: larger than what the other three fixes together take off"
    )
    assert raw["clipFraction"] > 5 * processed["clipFraction"]

    stale = results["locked + prefix caching"]
    assert stale["refusedByPolicy"] and "clearCache" in stale["refusedByPolicy"]
    assert stale["sharedPrefix"]["meanAbsDiff"] > 10 * results[locked]["sharedPrefix"]["meanAbsDiff"], (
        "with prefix caching on and clear_cache=False, requests after an update reuse KV from the old weights"
    )

    same_dtype = [name for name in results if not name.endswith("fp32 model") and results[name]["lora"] is None]
    closest = min(batch[name]["meanAbsDiff"] for name in same_dtype)
    # "locked + prefix caching" samples a single batch as the locked configuration does: a tie, up to noise.
    assert batch[locked]["meanAbsDiff"] <= closest * 1.001, "the locked configuration is the closest to the trainer"
    fp32 = batch[f"{locked}, fp32 model"]
    assert fp32["meanAbsDiff"] < min(1e-4, batch[locked]["meanAbsDiff"] / 100), "what is left in bf16 is numerics"
    assert all("outsideTopP" in c["topP"] for c in results.values()), "tokens outside top-p are counted apart"

    with_lora = results[f"{locked} + LoRA r16"]
    assert with_lora["lora"]["rank"] == 16
    budget = MismatchBudget().mean_abs_logprob_diff
    for name in ("batch", "topP", "sharedPrefix"):
        mismatch, effect = with_lora[name], with_lora["adapterEffect"][name]
        print(f"LoRA {name}: vLLM vs PEFT {mismatch['meanAbsDiff']:.2e}, adapter vs base {effect['meanAbsDiff']:.2e}")
        assert mismatch["tokens"] > 0 and mismatch["meanAbsDiff"] < budget, (name, mismatch)
        assert effect["meanAbsDiff"] > 10 * mismatch["meanAbsDiff"], ("the adapter changes the logprobs", name, effect)
