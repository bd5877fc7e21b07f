"""spec.output: when the trained model is written (``output_due``), and the write itself, reported on the pod."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from lockstep.api import Output
from lockstep.protocol import OutputResult
from lockstep_workers import export
from lockstep_workers.trainer.pod import (
    PodEnvironment,
    report_output,
)

if TYPE_CHECKING:
    pass

logger = logging.getLogger("lockstep.trainer")


def output_due(step: int, steps: int, every_steps: int) -> bool:
    """Whether spec.output is written after ``step`` of ``steps``: at the last, and every ``every_steps`` (0: never
    before the last)."""
    return step == steps or (every_steps > 0 and step % every_steps == 0)


def write_output(
    env: PodEnvironment, output: Output, model_path: str, version: int, last_evaluation: tuple[int, float] | None
) -> OutputResult:
    """Rank 0, once ``version`` is published: write it to spec.output (lockstep_workers.export) and report it on the
    pod (lockstep.dev/output), with ``last_evaluation`` (the version evaluated and its eval reward), if any; return
    the report."""
    writing = time.monotonic()
    path, digest = export.write_version(
        env.weights_dir, version, model_path, Path(output.path), output.dtype, output.merged
    )
    evaluated, reward = last_evaluation if last_evaluation is not None else (None, None)
    result = OutputResult(
        path=str(path), version=version, step=version, eval_reward=reward, eval_version=evaluated, digest=digest
    )
    if env.pod and env.namespace:
        report_output(result, env.namespace, env.pod)
    logger.info(
        "wrote weights version %d to %s in %.1fs (%s); serve it with: %s",
        version,
        path,
        time.monotonic() - writing,
        digest,
        export.serve_command(path),
    )
    return result
