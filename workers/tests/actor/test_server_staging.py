"""The actor's staging of a weights version from the job's weights directory (lockstep_workers.actor.server's
LoopEngine, without vLLM): a version with a tensor that is not finite is refused before the pause, so no engine ever
loads it; a LoRA job's adapter is checked as it is added (tests/actor/test_adapters.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from lockstep.protocol import Weights
from lockstep_workers.actor.server import LoopEngine
from lockstep_workers.weights.files import NonFiniteWeights, WeightsDirectory, digest_of, publish, version_path


def written_around_the_publish(directory: Path, version: int, tensors: dict[str, torch.Tensor]) -> Weights:
    """A version file written as a trainer without the publish's check would have written it."""
    directory.mkdir(parents=True, exist_ok=True)
    path = version_path(directory, version)
    save_file(tensors, path)
    return Weights(version=version, uri=path.resolve().as_uri(), digest=digest_of(path), bytes=path.stat().st_size)


def test_full_weights_with_a_tensor_that_is_not_finite_are_refused_as_they_are_staged(tmp_path: Path) -> None:
    directory = tmp_path / "weights"
    poisoned = written_around_the_publish(directory, 2, {"w": torch.tensor([1.0, float("nan")]), "b": torch.ones(1)})
    fine = publish({"w": torch.ones(2), "b": torch.ones(1)}, directory, version=3)
    actor: Any = SimpleNamespace(adapters=None)
    engine = LoopEngine(actor, loop=None, origin=WeightsDirectory(directory))  # type: ignore[arg-type]
    with pytest.raises(NonFiniteWeights, match=r"weights version 2: w hold NaN or infinite values .* refused"):
        engine.stage(poisoned, None)
    with engine.stage(fine, None) as staged:
        assert staged.weights == fine
