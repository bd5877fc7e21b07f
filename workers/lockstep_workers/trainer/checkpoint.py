"""The trainer's checkpoints: its model and optimizer shards, step and RNG states, saved with
torch.distributed.checkpoint in the job's directory every spec.trainer.checkpointEverySteps steps; the newest
spec.trainer.checkpointsKept are kept. Any number of ranks can load one, resharded as they are now.

``<shared dir>/checkpoints/step-<N>/`` holds the state after step N, whose weights are published as version N: the
step is also the position in the job's prompts (the prompt source is called with the step; the dataset's rows of a
step follow from it, lockstep_workers.rollout.dataset). A checkpoint is complete once its ``.metadata`` exists
(torch.distributed.checkpoint writes it last); an incomplete one is never loaded. A LoRA job's checkpoints hold its
adapter and the adapter's optimizer state, not the frozen base (``trainable_only``).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as load_shards
from torch.distributed.checkpoint.state_dict_saver import save as save_shards

COMPLETE = ".metadata"
TRAINABLE = StateDictOptions(ignore_frozen_params=True, strict=False)
"""A LoRA job's checkpoint: the trainable parameters (the adapter) and their optimizer state; the frozen base is the
model's own, loaded from its path again. Not strict, since the base's parameters are not in it (every adapter
parameter is: a checkpoint without one fails to load)."""


def checkpoints_directory(shared_dir: Path) -> Path:
    """Where the trainer keeps its checkpoints in the job's directory ($LOCKSTEP_SHARED_DIR)."""
    return shared_dir / "checkpoints"


def step_path(directory: Path, step: int) -> Path:
    return directory / f"step-{step:06d}"


def newest_checkpoint(directory: Path, at_most: int) -> int | None:
    """The newest complete checkpoint's step in ``directory`` that is no later than ``at_most``, if any."""
    steps = [int(path.name.removeprefix("step-")) for path in directory.glob("step-*") if (path / COMPLETE).exists()]
    return max((step for step in steps if step <= at_most), default=None)


def _rng_states(device: torch.device) -> dict[str, torch.Tensor]:
    """The RNG states of this process (the ranks share one seed, so rank 0's stand for all)."""
    states = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def save(
    directory: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    keep: int,
    *,
    trainable_only: bool = False,
) -> Path:
    """Save the state after ``step`` (every rank calls it: a collective) and remove all but the ``keep`` newest.
    ``trainable_only``: of the model, only the parameters that train (TRAINABLE)."""
    model_state, optimizer_state = get_state_dict(model, optimizer, options=_options(trainable_only))
    path = step_path(directory, step)
    state = {"model": model_state, "optimizer": optimizer_state, "trainer": {"step": step, "rng": _rng_states(device)}}
    save_shards(state, checkpoint_id=path)
    if dist.get_rank() == 0:
        complete = sorted(p for p in directory.glob("step-*") if (p / COMPLETE).exists())
        for old in complete[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return path


def load(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    *,
    trainable_only: bool = False,
) -> int:
    """Load the checkpoint at ``path`` into the shards of ``model`` and ``optimizer`` and this process's RNGs
    (every rank calls it: a collective); return its step. ``trainable_only``: as ``save`` saved it."""
    options = _options(trainable_only)
    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    saved = FileSystemReader(path).read_metadata().state_dict_metadata
    rng = {name: state for name, state in _rng_states(device).items() if f"trainer.rng.{name}" in saved}
    trainer: dict[str, Any] = {"step": 0, "rng": rng}
    state: dict[str, Any] = {"model": model_state, "optimizer": optimizer_state, "trainer": trainer}
    load_shards(state, checkpoint_id=path)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"], options=options
    )
    torch.set_rng_state(trainer["rng"]["cpu"])
    if "cuda" in trainer["rng"]:
        torch.cuda.set_rng_state(trainer["rng"]["cuda"], device)
    return int(trainer["step"])


def _options(trainable_only: bool) -> StateDictOptions | None:
    return TRAINABLE if trainable_only else None
