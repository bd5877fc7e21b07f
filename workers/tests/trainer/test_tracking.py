"""spec.trainer.tracking (lockstep_workers.trainer.tracking), read back with TensorBoard's own reader and MLflow's own
client from the store a job writes by default: each step's metrics under metrics.jsonl's names (none for a metric that
measured nothing), the effective configuration and its fingerprint, and a restarted trainer's steps in the same run."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lockstep.api import (
    MismatchBudget,
    MlflowTracking,
    ModelSource,
    Tracking,
    TrainerNumerics,
    Training,
    VllmSettings,
    WeightUpdateSemantics,
)
from lockstep.podconfig import PodConfig
from lockstep_workers.trainer.pod import PodEnvironment, record
from lockstep_workers.trainer.tracking import (
    CONFIG_TAG,
    FINGERPRINT_TAG,
    MLFLOW_FINGERPRINT_TAG,
    MLFLOW_RUN,
    MLFLOW_STORE,
    TensorBoardRun,
    open_runs,
    parameters,
    run_directory,
    scalars,
)

CONFIG = PodConfig(
    fingerprint="sha256:" + "ab" * 32,
    policy="default",
    model=ModelSource(uri="/models/base"),
    vllm=VllmSettings(),
    trainer=TrainerNumerics(),
    weight_update=WeightUpdateSemantics(),
    mismatch_budget=MismatchBudget(),
    training=Training(reward="lockstep_workers.rewards:target_words"),
)


def read(directory: Path) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(directory), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


def test_a_restarted_trainer_goes_on_with_the_same_run_under_metrics_jsonls_names(tmp_path: Path) -> None:
    env = PodEnvironment(0, 1, [], tmp_path, CONFIG, None, None, 0)
    first = TensorBoardRun(tmp_path, 1, CONFIG)
    record(env, 1, 2.5, {"reward": 0.25, "eval_reward": 0.1, "onpolicy_mean_abs_logprob_diff": 0.003}, first)
    record(env, 2, 2.0, {"reward": 0.5}, first)  # measured no on-policy mismatch: null in metrics.jsonl
    first.close(finished=False)
    resumed = TensorBoardRun(tmp_path, 3, CONFIG)
    record(env, 3, 1.5, {"reward": 0.75}, resumed)
    resumed.close(finished=True)

    run = read(run_directory(tmp_path))
    tags = run.Tags()
    assert {"reward", "eval_reward", "seconds", "version", "onpolicy_mean_abs_logprob_diff"} <= set(tags["scalars"])
    assert [(e.step, e.value) for e in run.Scalars("reward")] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert [(e.step, e.value) for e in run.Scalars("eval_reward")] == [(1, pytest.approx(0.1))]
    assert [e.step for e in run.Scalars("onpolicy_mean_abs_logprob_diff")] == [1], "none where nothing was measured"
    assert [e.step for e in run.Scalars("seconds")] == [1, 2, 3]
    fingerprint, config = (f"{tag}/text_summary" for tag in (FINGERPRINT_TAG, CONFIG_TAG))  # the text plugin's
    said = [(e.step, e.tensor_proto.string_val[0].decode()) for e in run.Tensors(fingerprint)]
    assert said == [(1, CONFIG.fingerprint), (3, CONFIG.fingerprint)], "each trainer's start"
    assert CONFIG.text() in run.Tensors(config)[0].tensor_proto.string_val[0].decode()
    assert len(list(run_directory(tmp_path).iterdir())) == 2, "one event file per trainer, in one run directory"


def test_an_mlflow_run_in_the_jobs_directory_is_resumed_by_a_restarted_trainer(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    env = PodEnvironment(0, 1, [], tmp_path, CONFIG, None, "team", 0, job="job")
    tracking = Tracking(mlflow=MlflowTracking())
    first = open_runs(tracking, tmp_path, 1, CONFIG, "job", "team")
    record(env, 1, 2.5, {"reward": 0.25, "onpolicy_mean_abs_logprob_diff": 0.003}, first)
    record(env, 2, 2.0, {"reward": 0.5}, first)
    assert first is not None
    first.close(finished=False)  # the trainer stopped: the operator starts another, which resumes from step 3
    resumed = open_runs(tracking, tmp_path, 3, CONFIG, "job", "team")
    record(env, 3, 1.5, {"reward": 0.75, "eval_reward": 0.4}, resumed)
    assert resumed is not None
    resumed.close(finished=True)

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / MLFLOW_STORE}")
    experiment = client.get_experiment_by_name("team/job")
    assert experiment is not None and experiment.artifact_location == (tmp_path / "mlflow-artifacts").as_uri()
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "job" and run.info.status == "FINISHED", "one run, finished by the last trainer"
    assert (tmp_path / MLFLOW_RUN).exists()
    history = client.get_metric_history(run.info.run_id, "reward")
    assert [(m.step, m.value) for m in history] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "onpolicy_mean_abs_logprob_diff")] == [1]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval_reward")] == [3]
    assert run.data.params == parameters(CONFIG)
    assert run.data.params["fingerprint"] == CONFIG.fingerprint and "training.reward" in run.data.params
    assert run.data.tags[MLFLOW_FINGERPRINT_TAG] == CONFIG.fingerprint
    assert run.data.tags["k8s.namespace.name"] == "team"
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id, "config")]
    assert artifacts == ["config/step-1.json", "config/step-3.json"], "each trainer's start"
    logged = client.download_artifacts(run.info.run_id, "config/step-3.json", str(tmp_path / "read"))
    assert Path(logged).read_text() == CONFIG.text()


def test_no_tracker_is_opened_unless_one_is_turned_on(tmp_path: Path) -> None:
    assert open_runs(Tracking(), tmp_path, 1, CONFIG, "job", "team") is None
    assert list(tmp_path.iterdir()) == []


@given(
    st.dictionaries(
        st.text(min_size=1),
        st.one_of(st.none(), st.booleans(), st.integers(-(2**53), 2**53), st.floats(), st.text()),
    )
)
def test_only_finite_numbers_are_logged_and_never_the_step(line: dict[str, object]) -> None:
    logged = scalars({**line, "step": 4})
    assert "step" not in logged
    for name, value in logged.items():
        assert math.isfinite(value) and line[name] == value and not isinstance(line[name], bool)
    assert all(
        name in logged
        for name, value in line.items()
        if name != "step" and isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    )
