"""Trainer rank 0's trace of each step (lockstep.tracing, docs/observability.md): a ``lockstep.step`` span on the
trainer's path, from the step's start to the hand-over of its publish, with a child per part the trainer times."""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry.util.types import AttributeValue

from lockstep.tracing import PREFIX, SpanData

TRAINER_SERVICE = "lockstep-trainer"
"""The trainer's service.name, unless OTEL_SERVICE_NAME sets another."""
STEP_SPAN = f"{PREFIX}.step"
STEP_PARTS = {
    "sampling_wait": "rollout_wait_seconds",
    "learn": "learn_seconds",
    "gather": "publish_gather_seconds",
    "publish": "publish_seconds",
}
"""A step's parts (child spans ``lockstep.step.<part>``) → the metric holding how long it took. The publish runs in
the background, past the step's end."""
STEP_ATTRIBUTES = ("publish_wait_seconds", "reward", "staleness")
"""The step's metrics that its span carries too, as ``lockstep.step.<metric>``."""


def step_span(
    step: int,
    started: float,
    seconds: float,
    starts: Mapping[str, float],
    metrics: Mapping[str, float],
    pod: str | None = None,
    namespace: str | None = None,
) -> SpanData:
    """The trace of ``step``: from ``started`` for ``seconds``, with a child per part of STEP_PARTS that has both a
    start in ``starts`` and a time in ``metrics``; the times are seconds since the epoch. ``pod`` and ``namespace``:
    where it ran, when known."""
    children = [
        SpanData(f"{STEP_SPAN}.{part}", *interval(starts[part], metrics[metric]))
        for part, metric in STEP_PARTS.items()
        if part in starts and metric in metrics
    ]
    where = {"k8s.pod.name": pod, "k8s.namespace.name": namespace}
    attributes: dict[str, AttributeValue] = {
        **{name: value for name, value in where.items() if value is not None},
        f"{STEP_SPAN}.number": step,
        f"{PREFIX}.weights.version": step,
        **{f"{STEP_SPAN}.{name}": metrics[name] for name in STEP_ATTRIBUTES if name in metrics},
    }
    return SpanData(STEP_SPAN, *interval(started, seconds), attributes, children=children)


def interval(start: float, seconds: float) -> tuple[int, int]:
    """From ``start`` (seconds since the epoch) for ``seconds``, in nanoseconds since the epoch (the duration
    converted alone: a float of the epoch's seconds holds only about a quarter of a microsecond)."""
    begin = round(start * 1e9)
    return begin, begin + round(seconds * 1e9)
