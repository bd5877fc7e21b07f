"""Whether an actor's memory limit holds announced weights while it stages them (lockstep.reconcile.memory)."""

from __future__ import annotations

import pytest

from lockstep.api import PodOverrides
from lockstep.protocol import PROTOCOL, Weights, read_document
from lockstep.reconcile.memory import size, staging_fit

GB = 10**9


def weights(size_bytes: int | None, version: int = 3) -> Weights:
    return Weights(version=version, uri=f"file:///w/v{version}", digest="sha256:0", bytes=size_bytes)


def actors(resources: dict[str, object]) -> PodOverrides:
    """spec.actors with these resources."""
    return PodOverrides.model_validate({"resources": resources})


def test_a_cpu_actor_must_hold_the_model_and_the_staged_copy() -> None:
    assert staging_fit(actors({"limits": {"memory": "1Gi"}}), weights(GB)) == (
        False,
        "actor memory limit 1Gi cannot hold weights version 3 (0.93 GiB) twice: staging needs the model and one "
        "staged copy in host memory, at least 1.87 GiB; raise spec.actors.resources.limits.memory",
    ), "the size needed is rounded up: a bound"
    assert staging_fit(actors({"limits": {"memory": "2Gi"}}), weights(GB)) == (
        True,
        "actor memory limit 2Gi holds weights version 3 (0.93 GiB) while an actor stages it (at least 1.87 GiB)",
    )


def test_a_gpu_actor_holds_one_copy_in_host_memory() -> None:
    gpu: dict[str, object] = {"limits": {"memory": "1Gi", "nvidia.com/gpu": 1}}
    assert staging_fit(actors(gpu), weights(GB)) == (
        True,
        "actor memory limit 1Gi holds weights version 3 (0.93 GiB) while an actor stages it (at least 0.94 GiB)",
    ), "the model itself is in GPU memory"
    requested: dict[str, object] = {"limits": {"memory": "512Mi"}, "requests": {"nvidia.com/gpu": "1"}}
    assert staging_fit(actors(requested), weights(GB)) == (
        False,
        "actor memory limit 512Mi cannot hold weights version 3 (0.93 GiB) in host memory: staging needs one copy "
        "there (the model is in GPU memory), at least 0.94 GiB; raise spec.actors.resources.limits.memory",
    )


@pytest.mark.parametrize(
    ("limit", "size_bytes", "fits"),
    [
        ("1Gi", (1 << 29), True),  # exactly twice: 2 x 512 MiB
        ("1Gi", (1 << 29) + 1, False),
        ("1G", 5 * 10**8, True),
        ("1G", 5 * 10**8 + 1, False),
        ("512Mi", 256 << 20, True),
        ("512Mi", (256 << 20) + 1, False),
        ("1073741824", 1 << 29, True),
        ("0.5Gi", 1 << 28, True),
        ("1e9", 5 * 10**8 + 1, False),
        ("1000M", 5 * 10**8, True),
    ],
)
def test_kubernetes_quantities(limit: str, size_bytes: int, fits: bool) -> None:
    fit = staging_fit(actors({"limits": {"memory": limit}}), weights(size_bytes))
    assert fit is not None and fit[0] is fits


def test_nothing_bounds_staging_without_a_limit_and_nothing_is_checked_without_a_size() -> None:
    unbounded = "the actors set no memory limit (spec.actors.resources.limits.memory): nothing bounds staging"
    for resources in ({}, {"requests": {"memory": "1Gi"}}, {"limits": {"cpu": "4"}}):
        assert staging_fit(actors(resources), weights(100 * GB)) == (True, f"{unbounded} weights version 3 (93.13 GiB)")
    assert staging_fit(actors({"limits": {"memory": "1Mi"}}), weights(None)) is None, "a trainer predating sizes"


def test_sizes_read_in_gib_or_below_a_tenth_of_one_in_mib() -> None:
    assert size(GB) == "0.93 GiB" and size(2 * GB, round_up=True) == "1.87 GiB"
    assert size(15 * (1 << 30)) == "15.00 GiB"
    assert size(50 << 20) == "50.00 MiB" and size(0) == "0.00 MiB"


def test_an_announcement_may_leave_out_its_size_but_not_give_a_negative_one() -> None:
    older = f'{{"protocol":{PROTOCOL},"version":1,"uri":"file:///w/v1","digest":"sha256:1"}}'
    parsed = read_document(older, Weights)
    assert isinstance(parsed, Weights) and parsed.bytes is None
    negative = read_document(older[:-1] + ',"bytes":-1}', Weights)
    assert negative == "is not a valid Weights document: bytes: Input should be greater than or equal to 0 (got -1)"
