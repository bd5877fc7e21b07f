"""OpenTelemetry traces (docs/observability.md): one trace per weight update, made by the operator when its barrier
closes, and one per trainer step, made by trainer rank 0 (lockstep_workers.trainer.traces).

The spans are built after the fact, from times Lockstep already records (a closed barrier's ``BarrierRecord``, a
step's timings), by pure functions returning ``SpanData``; ``emit`` hands them to a tracer. A process exports only
when ``tracer`` finds an OTLP endpoint in its environment (the standard ``OTEL_EXPORTER_OTLP_ENDPOINT`` or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``): otherwise there is no provider, no exporter and nothing to emit.

Names: the spans and Lockstep's own attributes are under ``lockstep.``; the Kubernetes ones follow OpenTelemetry's
semantic conventions (``k8s.namespace.name``, ``k8s.pod.name``). No GenAI convention applies: those describe
inference requests and agents, not training or weight updates.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Status, StatusCode, Tracer
from opentelemetry.util.types import AttributeValue

from lockstep.api import BarrierOutcome, BarrierRecord
from lockstep.barrier import NEXT_PHASE, ack_on
from lockstep.protocol import Ack, BarrierPhase, StepTimes
from lockstep.times import parse_rfc3339

ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT"
"""Where OTLP/HTTP spans go (``<endpoint>/v1/traces``); unset: no traces."""
TRACES_ENDPOINT = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
"""The traces' own OTLP endpoint (the whole URL); it takes precedence over ``ENDPOINT``."""
SERVICE = "OTEL_SERVICE_NAME"
"""The service the spans are from; unset: the process's default (``OPERATOR_SERVICE``, the trainer's)."""
OPERATOR_SERVICE = "lockstep-operator"
PREFIX = "lockstep"
BARRIER_SPAN = f"{PREFIX}.barrier"
MEMBER_SPAN = f"{BARRIER_SPAN}.member"


@dataclass(frozen=True)
class SpanData:
    """A finished span to emit: its times in nanoseconds since the epoch, its attributes, and its child spans."""

    name: str
    start_ns: int
    end_ns: int
    attributes: Mapping[str, AttributeValue] = field(default_factory=dict)
    error: str | None = None
    """Why the work failed (the span's status is then ERROR); None: it did not."""
    children: Sequence[SpanData] = ()


def forwarded(environ: Mapping[str, str]) -> dict[str, str]:
    """The OTLP endpoint variables set in ``environ`` (the operator's), which it gives the trainer pods: the
    trainers export where the operator does, as their own service (OTEL_SERVICE_NAME is not passed on)."""
    return {name: environ[name] for name in (ENDPOINT, TRACES_ENDPOINT) if environ.get(name)}


def tracer(environ: Mapping[str, str], service: str) -> Tracer | None:
    """A tracer that exports over OTLP/HTTP in batches when ``environ`` names an endpoint (the exporter reads the
    other standard OTEL_EXPORTER_OTLP_* variables itself), as ``OTEL_SERVICE_NAME`` or else ``service``; None, and
    nothing set up, when it names none."""
    if not (environ.get(TRACES_ENDPOINT) or environ.get(ENDPOINT)):
        return None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: environ.get(SERVICE) or service}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return provider.get_tracer(PREFIX)


def emit(tracer: Tracer, span: SpanData, parent: trace.Span | None = None) -> None:
    """Emit ``span`` and its children (a new trace when ``parent`` is None) with their recorded times."""
    context = trace.set_span_in_context(parent) if parent is not None else None
    started = tracer.start_span(span.name, context=context, attributes=span.attributes, start_time=span.start_ns)
    if span.error is not None:
        started.set_status(Status(StatusCode.ERROR, span.error))
    for child in span.children:
        emit(tracer, child, started)
    started.end(end_time=span.end_ns)


def nanoseconds(moment: dt.datetime) -> int:
    return int(moment.timestamp() * 1e9)


def epoch_nanoseconds(seconds: float) -> int:
    return round(seconds * 1e9)


def barrier_acks(pods: Iterable[dict[str, Any]], barrier_id: str) -> dict[str, Ack]:
    """The acks of barrier ``barrier_id`` on ``pods``, by pod name (a pod with none, another barrier's or an
    unreadable one is left out)."""
    acks: dict[str, Ack] = {}
    for pod in pods:
        ack = ack_on(pod)
        if isinstance(ack, Ack) and ack.id == barrier_id:
            acks[pod["metadata"]["name"]] = ack
    return acks


def member_span(pod: str, ack: Ack) -> SpanData | None:
    """A member's part in a barrier, from its last ack: a ``lockstep.barrier.member`` span from its first step's
    start to its last step's end, with ``k8s.pod.name``, the version it holds and its error, and a child per step
    it timed (``.stage``, ``.pause``, ``.load``, ``.resume``) at the times the pod measured on its own clock. None
    when the ack times nothing (an agent that predates the timings)."""
    if not ack.timings:
        return None
    steps = sorted(ack.timings.items(), key=lambda item: item[1].start)
    children = [SpanData(f"{MEMBER_SPAN}.{step.value}", *_span_times(times)) for step, times in steps]
    attributes: dict[str, AttributeValue] = {"k8s.pod.name": pod, f"{MEMBER_SPAN}.acked": ack.phase}
    if ack.loaded_version is not None:
        attributes[f"{PREFIX}.weights.version"] = ack.loaded_version
    start = min(child.start_ns for child in children)
    end = max(child.end_ns for child in children)
    return SpanData(MEMBER_SPAN, start, end, attributes, ack.error, children)


def _span_times(times: StepTimes) -> tuple[int, int]:
    start = epoch_nanoseconds(times.start)
    return start, max(start, epoch_nanoseconds(times.end))


def barrier_span(
    namespace: str, job: str, record: BarrierRecord, acks: Mapping[str, Ack] | None = None
) -> SpanData | None:
    """The trace of a closed barrier: a ``lockstep.barrier`` span from its opening to its closing, with a child
    per phase it went through (``lockstep.barrier.pause``, ``.update``, ``.resume``; it opens in Update, in Resume
    when rolling, in Pause when it retries a transfer) back to back at their measured times, and, when it did not
    complete, the phase after the last it finished, ending when it closed (none when it finished none); then a
    ``member_span`` for each member pod's ack in ``acks`` that times its steps. None for a record without its
    closing time."""
    if record.finished_at is None:
        return None
    end = nanoseconds(parse_rfc3339(record.finished_at))
    start = end - round(record.seconds * 1e9)
    finished = [phase for phase in BarrierPhase if phase.value in record.phase_seconds]
    phases: list[SpanData] = []
    moment = start
    for phase in finished:
        until = min(moment + max(round(record.phase_seconds[phase.value] * 1e9), 0), end)
        phases.append(SpanData(f"{BARRIER_SPAN}.{phase.value.lower()}", moment, until))
        moment = until
    closed_in = NEXT_PHASE.get(finished[-1]) if finished and record.outcome is not BarrierOutcome.COMPLETED else None
    if closed_in is not None:
        phases.append(SpanData(f"{BARRIER_SPAN}.{closed_in.value.lower()}", moment, end))
    attributes: dict[str, AttributeValue] = {
        "k8s.namespace.name": namespace,
        f"{PREFIX}.job": job,
        f"{BARRIER_SPAN}.id": record.id,
        f"{PREFIX}.weights.version": record.version,
        f"{BARRIER_SPAN}.outcome": record.outcome.value,
        f"{BARRIER_SPAN}.members": record.members,
        f"{BARRIER_SPAN}.evicted": list(record.evicted),
    }
    if record.bytes is not None:
        attributes[f"{PREFIX}.weights.bytes"] = record.bytes
    if record.slowest_pod is not None:
        attributes[f"{BARRIER_SPAN}.slowest_pod"] = record.slowest_pod
    if record.reason is not None:
        attributes[f"{BARRIER_SPAN}.reason"] = record.reason
    failed = record.outcome is BarrierOutcome.FAILED
    error = (record.error or "the barrier failed") if failed else None
    members = [span for pod, ack in sorted((acks or {}).items()) if (span := member_span(pod, ack)) is not None]
    return SpanData(BARRIER_SPAN, start, end, attributes, error, [*phases, *members])
