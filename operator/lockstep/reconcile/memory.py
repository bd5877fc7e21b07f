"""Whether the actors can stage announced weights in host memory. An actor reads and verifies a new version into
host memory while it generates, so during an update it holds one copy of the weights more than it serves: its
memory limit must hold that copy and, on a pod without a GPU, the model too (the model is in GPU memory on a GPU
pod). The limit checked is the one the operator renders into the actor pods (spec.actors.resources.limits.memory;
the actors whose pod spec differs are replaced before a barrier counts them). A version that does not fit opens
no barrier: its announcement stays, and the barrier opens once the actors can hold it (a raised limit replaces
them), while WeightsFitMemory=False says what to raise, before the kernel's OOM killer could."""

from __future__ import annotations

import math

from kubernetes.utils import parse_quantity

from lockstep import desired
from lockstep.api import PodOverrides, RLJobSpec
from lockstep.conditions import WEIGHTS_FIT_MEMORY
from lockstep.protocol import Weights
from lockstep.reconcile.context import Pass
from lockstep.reconcile.reasons import Reason

GIB = 1 << 30
MIB = 1 << 20
LIMIT_FIELD = "spec.actors.resources.limits.memory"


def copies_while_staging(actors: PodOverrides) -> int:
    """Copies of the weights an actor holds in host memory while it stages a version: the staged one and, on a
    pod without a GPU, the model it serves."""
    return 1 if desired.requests_gpu(actors) else 2


def staging_fit(actors: PodOverrides, weights: Weights) -> tuple[bool, str] | None:
    """Whether actors rendered from ``actors`` (spec.actors) can stage ``weights`` in their memory limit, and
    why, in words for WeightsFitMemory; None when the version's size is unknown (nothing to check)."""
    if weights.bytes is None:
        return None
    version = f"weights version {weights.version} ({size(weights.bytes)})"
    limit = ((actors.resources.limits if actors.resources else None) or {}).get("memory")
    if limit is None:
        return True, f"the actors set no memory limit ({LIMIT_FIELD}): nothing bounds staging {version}"
    copies = copies_while_staging(actors)
    needed = copies * weights.bytes
    at_least = size(needed, round_up=True)
    if parse_quantity(limit) >= needed:
        return True, f"actor memory limit {limit} holds {version} while an actor stages it (at least {at_least})"
    held = (
        "twice: staging needs the model and one staged copy in host memory"
        if copies == 2
        else "in host memory: staging needs one copy there (the model is in GPU memory)"
    )
    return False, f"actor memory limit {limit} cannot hold {version} {held}, at least {at_least}; raise {LIMIT_FIELD}"


def size(count: int, *, round_up: bool = False) -> str:
    """``count`` bytes for people: GiB from a tenth of one, MiB below, two decimals (rounded up: a bound)."""
    unit, name = (GIB, "GiB") if count >= GIB // 10 else (MIB, "MiB")
    value = count / unit
    return f"{math.ceil(value * 100) / 100 if round_up else value:.2f} {name}"


def fits(run: Pass, spec: RLJobSpec, weights: Weights | None) -> bool:
    """Whether a barrier may open for ``weights``: the job's actors can stage the version in their memory limit.
    Once a version of known size is announced, WeightsFitMemory says so (False names the limit and the size
    needed; its transition is a Warning Event)."""
    fit = None if weights is None else staging_fit(spec.actors, weights)
    if weights is None or fit is None:
        return True
    ok, why = fit
    if ok:
        run.condition(WEIGHTS_FIT_MEMORY, True, Reason.WITHIN_MEMORY_LIMIT, why)
    else:
        waits = f"; no barrier opens for version {weights.version} until then (its announcement stays)"
        run.condition(WEIGHTS_FIT_MEMORY, False, Reason.ACTOR_MEMORY_LIMIT_TOO_LOW, why + waits)
    return ok
