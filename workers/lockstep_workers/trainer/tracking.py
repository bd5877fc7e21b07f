"""Experiment tracking (spec.trainer.tracking): trainer rank 0's run, as TensorBoard event files and as an MLflow run.

Both log each step's numbers under metrics.jsonl's names (a metric that measured nothing, null there, is left out),
at the step's number, and the effective configuration (the PodConfig) and its fingerprint at the step each trainer
starts from; a restarted trainer goes on with the same run.

- TensorBoard: event files in tensorboard/ beside metrics.jsonl, which `tensorboard --logdir` reads with no server of
  Lockstep's. The run is the directory: a restarted trainer opens a new event file in it, and TensorBoard shows the
  files of a directory as one run.
- MLflow, through its own client: a tracking server, or by default a SQLite store in the job's directory
  (mlflow.db, artifacts in mlflow-artifacts/). The run's id is kept in mlflow-run.json in the job's directory, which
  a restarted trainer reads to resume that run.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from lockstep.api import MlflowTracking, Tracking
from lockstep.podconfig import PodConfig

DIRECTORY = "tensorboard"
"""The TensorBoard run's directory, in the job's directory (beside metrics.jsonl)."""
CONFIG_TAG = "lockstep/effective_config"
FINGERPRINT_TAG = "lockstep/config_fingerprint"
MLFLOW_STORE = "mlflow.db"
MLFLOW_ARTIFACTS = "mlflow-artifacts"
MLFLOW_RUN = "mlflow-run.json"
"""Which MLflow run is the job's: ``{"trackingUri": ..., "runId": ...}``, in the job's directory."""
MLFLOW_FINGERPRINT_TAG = "lockstep.config_fingerprint"
MLFLOW_JOB_TAG = "lockstep.job"
MLFLOW_NAMESPACE_TAG = "k8s.namespace.name"
MLFLOW_BATCH = 100
"""The most metrics or parameters MLflow takes in one log_batch call (its REST API's limit for parameters)."""
MLFLOW_PARAMETER_LENGTH = 6000
"""The longest parameter value MLflow keeps; a longer one is cut (the configuration artifact has it whole)."""


def run_directory(shared_dir: Path) -> Path:
    """Where the job's TensorBoard run is, in the job's directory ($LOCKSTEP_SHARED_DIR)."""
    return shared_dir / DIRECTORY


def scalars(line: Mapping[str, Any]) -> dict[str, float]:
    """What the trackers log of a metrics.jsonl line: its finite numbers by name, without the step it is logged at
    (null and non-finite values, which measured nothing, are left out)."""
    return {
        name: float(value)
        for name, value in line.items()
        if name != "step" and isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    }


def parameters(config: PodConfig) -> dict[str, str]:
    """The effective configuration as MLflow parameters: each leaf of its JSON by its dotted path (lists whole, as
    JSON), e.g. ``vllm.logprobsMode``, cut at MLflow's longest value."""
    flat: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for key, inner in value.items():
                walk(f"{prefix}.{key}" if prefix else key, inner)
        else:
            text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
            flat[prefix] = text[:MLFLOW_PARAMETER_LENGTH]

    walk("", json.loads(config.text()))
    return flat


class Run(Protocol):
    """One tracker's run of the job."""

    def log(self, step: int, line: Mapping[str, Any]) -> None:
        """Log the metrics.jsonl ``line`` of ``step``, durably (a pod may go at any moment)."""

    def close(self, finished: bool) -> None:
        """End this trainer's part of the run; ``finished``: the job's training is done."""


class Runs:
    """The trackers spec.trainer.tracking turns on, opened by trainer rank 0 at ``first_step``; each line goes to
    every one."""

    def __init__(self, runs: list[Run]) -> None:
        self.runs = runs

    def log(self, step: int, line: Mapping[str, Any]) -> None:
        for run in self.runs:
            run.log(step, line)

    def close(self, finished: bool) -> None:
        for run in self.runs:
            run.close(finished)


def open_runs(
    tracking: Tracking,
    shared_dir: Path | None,
    first_step: int,
    config: PodConfig | None,
    job: str | None,
    namespace: str | None,
) -> Runs | None:
    """Rank 0's runs of the trackers ``tracking`` turns on, in the job's directory ``shared_dir`` (every trainer pod
    has one), or None when it turns on none."""
    if not tracking.tensorboard and tracking.mlflow is None:
        return None
    assert shared_dir is not None, "spec.trainer.tracking keeps its runs in the job's directory ($LOCKSTEP_SHARED_DIR)"
    runs: list[Run] = []
    if tracking.tensorboard:
        runs.append(TensorBoardRun(shared_dir, first_step, config))
    if tracking.mlflow is not None:
        runs.append(MlflowRun(tracking.mlflow, shared_dir, first_step, config, job, namespace))
    return Runs(runs)


def _import_or_exit(what: str, field: str, package: str) -> Any:
    """Import ``what`` or exit saying which field needs which package."""
    import importlib

    try:
        return importlib.import_module(what)
    except ImportError as error:
        raise SystemExit(
            f"spec.trainer.tracking.{field} needs the {package} package, which this trainer image lacks ({error}): use "
            f"an image with lockstep[workers], or turn {field} off"
        ) from error


class TensorBoardRun:
    """The job's TensorBoard run, opened by trainer rank 0 at ``first_step`` with the job's ``config``."""

    def __init__(self, shared_dir: Path, first_step: int, config: PodConfig | None) -> None:
        summary = _import_or_exit("torch.utils.tensorboard", "tensorboard", "tensorboard")
        self.writer = summary.SummaryWriter(log_dir=str(run_directory(shared_dir)))
        if config is not None:
            self.writer.add_text(CONFIG_TAG, f"```json\n{config.text()}\n```", global_step=first_step)
            self.writer.add_text(FINGERPRINT_TAG, config.fingerprint, global_step=first_step)
        self.writer.flush()

    def log(self, step: int, line: Mapping[str, Any]) -> None:
        for name, value in scalars(line).items():
            self.writer.add_scalar(name, value, global_step=step)
        self.writer.flush()

    def close(self, finished: bool) -> None:
        self.writer.close()


class MlflowRun:
    """The job's MLflow run, through MLflow's own client: created by the first trainer (the configuration as its
    parameters), resumed by a restarted one; each trainer's start logs the configuration as an artifact
    (``config/step-<n>.json``) and its fingerprint as a tag."""

    def __init__(
        self,
        settings: MlflowTracking,
        shared_dir: Path,
        first_step: int,
        config: PodConfig | None,
        job: str | None,
        namespace: str | None,
    ) -> None:
        tracking = _import_or_exit("mlflow.tracking", "mlflow", "mlflow-skinny")
        self.uri = settings.tracking_uri or f"sqlite:///{shared_dir / MLFLOW_STORE}"
        self.client = tracking.MlflowClient(tracking_uri=self.uri)
        record = shared_dir / MLFLOW_RUN
        known = json.loads(record.read_text()) if record.exists() else {}
        if known.get("trackingUri") == self.uri:
            self.run_id: str = known["runId"]
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            name = settings.experiment or f"{namespace or 'default'}/{job or 'job'}"
            found = self.client.get_experiment_by_name(name)
            if found is not None:
                experiment = found.experiment_id
            else:  # a local store keeps the artifacts in the job's directory too; a server decides for itself
                artifacts = None if settings.tracking_uri else (shared_dir / MLFLOW_ARTIFACTS).as_uri()
                experiment = self.client.create_experiment(name, artifact_location=artifacts)
            tags = {MLFLOW_JOB_TAG: job or "", MLFLOW_NAMESPACE_TAG: namespace or ""}
            self.run_id = self.client.create_run(experiment, run_name=job, tags=tags).info.run_id
            if config is not None:
                self._log_batch(params=parameters(config))
            temporary = record.with_suffix(".tmp")
            temporary.write_text(json.dumps({"trackingUri": self.uri, "runId": self.run_id}))
            temporary.replace(record)
        if config is not None:
            self.client.set_tag(self.run_id, MLFLOW_FINGERPRINT_TAG, config.fingerprint)
            self.client.log_text(self.run_id, config.text(), f"config/step-{first_step}.json")

    def log(self, step: int, line: Mapping[str, Any]) -> None:
        self._log_batch(metrics=scalars(line), step=step)

    def close(self, finished: bool) -> None:
        self.client.set_terminated(self.run_id, status="FINISHED" if finished else "FAILED")

    def _log_batch(
        self, *, metrics: Mapping[str, float] | None = None, params: Mapping[str, str] | None = None, step: int = 0
    ) -> None:
        from mlflow.entities import Metric, Param

        now = int(time.time() * 1000)
        logged = [Metric(name, value, now, step) for name, value in (metrics or {}).items()]
        given = [Param(name, value) for name, value in (params or {}).items()]
        for start in range(0, max(len(logged), len(given)), MLFLOW_BATCH):
            chunk = slice(start, start + MLFLOW_BATCH)
            self.client.log_batch(self.run_id, metrics=logged[chunk], params=given[chunk])
