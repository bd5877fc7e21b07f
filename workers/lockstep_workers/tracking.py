"""Experiment tracking (spec.trainer.tracking): trainer rank 0's run as TensorBoard event files in tensorboard/ beside
metrics.jsonl, which `tensorboard --logdir` reads with no server of Lockstep's.

The run is the directory: a restarted trainer opens a new event file in the same directory, and TensorBoard shows
the files of a directory as one run, its steps going on from where the trainer resumed. Each step's numbers are
logged under metrics.jsonl's names (a metric that measured nothing, null there, is left out), at the step's number;
the effective configuration (the PodConfig) and its fingerprint as text, at the step each trainer starts from.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lockstep.podconfig import PodConfig

DIRECTORY = "tensorboard"
"""The run's directory, in the job's directory (beside metrics.jsonl)."""
CONFIG_TAG = "lockstep/effective_config"
FINGERPRINT_TAG = "lockstep/config_fingerprint"


def run_directory(shared_dir: Path) -> Path:
    """Where the job's TensorBoard run is, in the job's directory ($LOCKSTEP_SHARED_DIR)."""
    return shared_dir / DIRECTORY


def scalars(line: Mapping[str, Any]) -> dict[str, float]:
    """What TensorBoard logs of a metrics.jsonl line: its finite numbers by name, without the step it is logged at
    (null and non-finite values, which measured nothing, are left out)."""
    return {
        name: float(value)
        for name, value in line.items()
        if name != "step" and isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    }


class TensorBoardRun:
    """The job's TensorBoard run, opened by trainer rank 0 at ``first_step`` with the job's ``config``."""

    def __init__(self, shared_dir: Path, first_step: int, config: PodConfig | None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            raise SystemExit(
                f"spec.trainer.tracking.tensorboard needs the tensorboard package, which this trainer image lacks "
                f"({error}): use an image with lockstep[workers], or set tensorboard to false"
            ) from error
        self.writer = SummaryWriter(log_dir=str(run_directory(shared_dir)))
        if config is not None:
            self.writer.add_text(CONFIG_TAG, f"```json\n{config.text()}\n```", global_step=first_step)
            self.writer.add_text(FINGERPRINT_TAG, config.fingerprint, global_step=first_step)
        self.writer.flush()

    def log(self, step: int, line: Mapping[str, Any]) -> None:
        """Log the metrics.jsonl ``line`` of ``step``, and flush it to disk (a pod may go at any moment)."""
        for name, value in scalars(line).items():
            self.writer.add_scalar(name, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
