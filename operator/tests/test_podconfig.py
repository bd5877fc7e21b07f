"""The operator-to-pod contract (issue 25 item 2): the PodConfig the operator renders into the job's ConfigMap is
the one each pod's ``load_pod_config`` reads back, and the actor flags ``actor_args`` renders are the settings
``parse_actor_args`` reads back."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from factories import NOW, REWARD, job, policy
from lockstep import desired, environment, keys
from lockstep.api import DType, LogprobsMode, RLJobSpec, VllmSettings
from lockstep.parity import default_policy, effective_config
from lockstep.podconfig import ActorArgs, PodConfig, actor_args, load_pod_config, parse_actor_args, vllm_flags
from lockstep.reconcile import Observed, reconcile

POSITIVE = st.integers(min_value=1, max_value=2**40)
SETTINGS: dict[str, st.SearchStrategy[Any]] = {
    "logprobs_mode": st.sampled_from(LogprobsMode),
    "enable_prefix_caching": st.booleans(),
    "async_scheduling": st.booleans(),
    "disable_cascade_attn": st.booleans(),
    "hf_overrides": st.dictionaries(
        st.text(min_size=1, max_size=8),
        st.one_of(st.text(max_size=8), st.integers(), st.floats(allow_nan=False), st.booleans()),
        max_size=3,
    ),
    "dtype": st.sampled_from(DType),
    "max_model_len": POSITIVE,
    "max_num_seqs": POSITIVE,
    "max_num_batched_tokens": POSITIVE,
    "gpu_memory_utilization": st.floats(min_value=0, max_value=1, exclude_min=True),
    "tensor_parallel_size": POSITIVE,
    "enforce_eager": st.booleans(),
    "enable_chunked_prefill": st.booleans(),
    "seed": st.integers(),
}
vllm_settings = st.fixed_dictionaries({}, optional=SETTINGS).map(lambda given: VllmSettings(**given))
JOB = desired.JobRef("demo", "team-a", "uid-1")


def test_the_strategy_sets_every_vllm_setting() -> None:
    assert set(SETTINGS) == set(VllmSettings.model_fields), "a new VllmSettings field needs a strategy here"


@given(settings=vllm_settings, port=st.integers(min_value=1, max_value=65535))
def test_the_actor_reads_back_the_flags_the_operator_renders(settings: VllmSettings, port: int) -> None:
    assert parse_actor_args(actor_args("/models/tiny", port, settings)) == ActorArgs("/models/tiny", port, settings)


def test_the_flags_are_vllm_serves_spelled_in_the_order_of_their_names() -> None:
    settings = VllmSettings(
        enforce_eager=True, enable_prefix_caching=False, hf_overrides={"head_dtype": "float32"}, max_model_len=256
    )
    assert vllm_flags(settings) == [
        "--no-enable-prefix-caching",
        "--enforce-eager",
        '--hf-overrides={"head_dtype":"float32"}',
        "--max-model-len=256",
    ]


def test_a_flag_that_does_not_fit_its_setting_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_actor_args(["--model=/m", "--max-model-len=0", "--dtype=float64"])
    refused = capsys.readouterr().err
    assert "--max-model-len: Input should be greater than or equal to 1" in refused, refused
    assert "--dtype: Input should be 'auto', 'bfloat16', 'float16' or 'float32'" in refused, refused


def spec_with(vllm: VllmSettings, **trainer: Any) -> RLJobSpec:
    body = job()["spec"]
    body["actors"]["vllm"] = vllm.model_dump(mode="json", by_alias=True, exclude_none=True)
    body["trainer"].update(trainer)
    return RLJobSpec.model_validate(body)


def read_back(config_map: dict[str, Any]) -> PodConfig | None:
    """What a pod's load_pod_config reads from ``config_map``, mounted where the operator mounts it."""
    with tempfile.TemporaryDirectory() as mount:
        for key, text in config_map["data"].items():
            (Path(mount) / key).write_text(text)
        return load_pod_config({environment.CONFIG: str(Path(mount) / environment.CONFIG_FILE)})


@given(settings=vllm_settings, steps=st.integers(min_value=1, max_value=10**6), lag=st.integers(0, 8))
def test_a_pod_reads_back_the_configuration_the_operator_renders(settings: VllmSettings, steps: int, lag: int) -> None:
    spec = spec_with(settings, steps=steps, maxLag=lag)
    config = effective_config(spec, default_policy())
    loaded = read_back(desired.config_map(JOB, spec, config))
    assert loaded is not None and loaded == desired.pod_config(spec, config)
    assert loaded.training == spec.trainer.training() and loaded.vllm == config.vllm_settings
    parity = loaded.model_dump(mode="json", by_alias=True, exclude_none=True, include={"model", "vllm", "trainer"})
    parity["weightUpdate"] = loaded.weight_update.model_dump(mode="json", by_alias=True)
    assert parity == config.document(), "the pods read what their config fingerprint covers"


def test_the_config_map_holds_the_pod_config_and_nothing_else() -> None:
    plan = reconcile(Observed(job(), [], [policy()], {}, NOW))
    [config_map] = [child for child in plan.children if child["kind"] == "ConfigMap"]
    assert list(config_map["data"]) == [environment.CONFIG_FILE], "nothing reads another key (vllm-args went)"
    loaded = read_back(config_map)
    assert loaded is not None and loaded.training.reward == REWARD
    [pod] = [p for p in plan.create_pods if p["metadata"]["name"] == desired.rank0_name("demo")]
    assert loaded.fingerprint == pod["metadata"]["annotations"][keys.CONFIG_FINGERPRINT]
    assert pod["spec"]["containers"][0]["args"] == ["--model=/models/tiny"], "the settings come from the PodConfig"


def test_a_change_of_the_training_settings_replaces_the_trainer_pods_only() -> None:
    def hashes(**trainer: Any) -> dict[str, str]:
        spec = spec_with(VllmSettings(), **trainer)
        pods = desired.pods(JOB, spec, effective_config(spec, default_policy()))
        return {pod["metadata"]["name"]: pod["metadata"]["annotations"][keys.TEMPLATE_HASH] for pod in pods}

    before, after = hashes(steps=10), hashes(steps=11)
    assert before["demo-trainer-0"] != after["demo-trainer-0"], "the trainer reads spec.trainer.steps at start"
    assert {name: h for name, h in before.items() if "actor" in name} == {
        name: h for name, h in after.items() if "actor" in name
    }


def test_a_worker_outside_a_job_has_no_pod_config_and_a_bad_one_is_named(tmp_path: Path) -> None:
    assert load_pod_config({}) is None
    path = tmp_path / environment.CONFIG_FILE
    path.write_text('{"fingerprint": "sha256:x", "policy": "default"}')
    with pytest.raises(SystemExit) as refused:
        load_pod_config({environment.CONFIG: str(path)})
    assert f"{environment.CONFIG}: {path} is not a Lockstep pod configuration (model: Field required;" in str(
        refused.value
    )
    assert "training: Field required" in str(refused.value)
    with pytest.raises(SystemExit) as unreadable:
        load_pod_config({environment.CONFIG: str(tmp_path / "missing.json")})
    assert "cannot be read (No such file or directory)" in str(unreadable.value)
