"""Whether the actors can stage announced weights in host memory. An actor reads and verifies a new version into
host memory while it generates, so during an update it holds one copy of the weights more than it serves: its
memory limit must hold that copy and, on a pod without a GPU, the model too (the model is in GPU memory on a GPU
pod). A version that does not fit opens no barrier: its announcement stays, and the barrier opens once the actors
can hold it (a raised spec.actors.resources.limits.memory replaces them), while WeightsFitMemory=False says what
to raise, before the kernel's OOM killer could."""

from __future__ import annotations

import math
from typing import Any

from kubernetes.utils import parse_quantity

from lockstep import desired, keys
from lockstep.conditions import WEIGHTS_FIT_MEMORY
from lockstep.protocol import Weights
from lockstep.reconcile.context import Pass
from lockstep.reconcile.reasons import Reason

GIB = 1 << 30
MIB = 1 << 20
LIMIT_FIELD = "spec.actors.resources.limits.memory"


def copies_while_staging(resources: dict[str, Any]) -> int:
    """Copies of the weights an actor container with ``resources`` (as in a pod) holds in host memory while it
    stages a version: the staged one and, without a GPU, the model it serves."""
    gpu = any(desired.GPU in (resources.get(kind) or {}) for kind in ("limits", "requests"))
    return 1 if gpu else 2


def limit_problem(resources: dict[str, Any], weights: Weights) -> str | None:
    """Why an actor container with ``resources`` (as in a pod) cannot stage ``weights``, in words for the
    condition; None when it can, when it sets no memory limit, or when the version's size is unknown."""
    limit = (resources.get("limits") or {}).get("memory")
    if limit is None or weights.bytes is None:
        return None
    copies = copies_while_staging(resources)
    needed = copies * weights.bytes
    if parse_quantity(limit) >= needed:
        return None
    held = (
        "twice: staging needs the model and one staged copy in host memory"
        if copies == 2
        else "in host memory: staging needs one copy there (the model is in GPU memory)"
    )
    return (
        f"actor memory limit {limit} cannot hold weights version {weights.version} ({size(weights.bytes)}) {held}, "
        f"at least {size(needed, round_up=True)}; raise {LIMIT_FIELD}"
    )


def size(count: int, *, round_up: bool = False) -> str:
    """``count`` bytes for people: GiB from a tenth of one, MiB below, two decimals (rounded up: a bound)."""
    unit, name = (GIB, "GiB") if count >= GIB // 10 else (MIB, "MiB")
    value = count / unit
    return f"{math.ceil(value * 100) / 100 if round_up else value:.2f} {name}"


def fits(run: Pass, weights: Weights | None, actors: dict[str, dict[str, Any]]) -> bool:
    """Whether a barrier may open for ``weights`` over the running ``actors`` (by name): each one's memory limit
    holds the version while it stages it. Once a version of known size meets running actors, WeightsFitMemory says so
    (False names the limit and the size needed; its transition is a Warning Event)."""
    if weights is None or weights.bytes is None or not actors:
        return True
    found = (limit_problem(_actor_resources(pod), weights) for _, pod in sorted(actors.items()))
    problems = [problem for problem in found if problem is not None]
    if problems:
        waits = f"; no barrier opens for version {weights.version} until then (its announcement stays)"
        run.condition(WEIGHTS_FIT_MEMORY, False, Reason.ACTOR_MEMORY_LIMIT_TOO_LOW, problems[0] + waits)
        return False
    run.condition(
        WEIGHTS_FIT_MEMORY,
        True,
        Reason.WITHIN_MEMORY_LIMIT,
        f"every actor's memory limit (or none) holds weights version {weights.version} ({size(weights.bytes)}) "
        "and the copy it stages",
    )
    return True


def _actor_resources(pod: dict[str, Any]) -> dict[str, Any]:
    """The resources of the pod's actor container, as the API server admitted them (a LimitRange's defaults
    included)."""
    containers = (pod.get("spec") or {}).get("containers") or []
    actor: dict[str, Any] = next((c for c in containers if c.get("name") == keys.ACTOR), {})
    return dict(actor.get("resources") or {})
