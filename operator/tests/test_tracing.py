"""The weight updates' traces (lockstep.tracing): a closed barrier's spans, read back from the OpenTelemetry SDK's
in-memory exporter, and no tracer without an endpoint."""

from __future__ import annotations

from opentelemetry.sdk.trace import ReadableSpan, Tracer, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from lockstep import tracing
from lockstep.api import BarrierOutcome, BarrierRecord
from lockstep.keys import BARRIER_ACK
from lockstep.protocol import Ack, document
from lockstep.times import parse_rfc3339

CLOSED = "2026-12-04T10:00:10.000Z"
CLOSED_NS = tracing.nanoseconds(parse_rfc3339(CLOSED))
SECOND = 10**9


def exported(span: tracing.SpanData) -> dict[str, ReadableSpan]:
    """``span`` emitted through a real SDK provider: the finished spans by name."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.emit(provider.get_tracer("test"), span)
    return {finished.name: finished for finished in exporter.get_finished_spans()}


def record(outcome: BarrierOutcome, phase_seconds: dict[str, float], **more: object) -> BarrierRecord:
    return BarrierRecord.model_validate(
        {
            "id": "uid/7",
            "version": 7,
            "outcome": outcome,
            "seconds": 6.0,
            "phaseSeconds": phase_seconds,
            "members": 3,
            "finishedAt": CLOSED,
            **more,
        }
    )


def test_a_completed_barrier_is_one_trace_with_a_span_per_phase_at_its_measured_times() -> None:
    closed = record(
        BarrierOutcome.COMPLETED,
        {"Pause": 1.0, "Update": 3.5, "Resume": 1.5},  # a transfer's retry: it opened in Pause
        slowestPod="job-actor-2",
        evicted=["job-actor-1"],
        bytes=2048,
    )
    span = tracing.barrier_span("team", "job", closed)
    assert span is not None
    spans = exported(span)

    root = spans["lockstep.barrier"]
    assert (root.start_time, root.end_time) == (CLOSED_NS - 6 * SECOND, CLOSED_NS)
    assert root.parent is None and root.status.status_code is StatusCode.UNSET
    assert dict(root.attributes or {}) == {
        "k8s.namespace.name": "team",
        "lockstep.job": "job",
        "lockstep.barrier.id": "uid/7",
        "lockstep.weights.version": 7,
        "lockstep.weights.bytes": 2048,
        "lockstep.barrier.outcome": "Completed",
        "lockstep.barrier.members": 3,
        "lockstep.barrier.evicted": ("job-actor-1",),
        "lockstep.barrier.slowest_pod": "job-actor-2",
    }
    times = {
        name: ((s.start_time or 0) - CLOSED_NS, (s.end_time or 0) - CLOSED_NS)
        for name, s in spans.items()
        if name != "lockstep.barrier"
    }
    assert times == {
        "lockstep.barrier.pause": (-6 * SECOND, -5 * SECOND),
        "lockstep.barrier.update": (-5 * SECOND, -SECOND * 3 // 2),
        "lockstep.barrier.resume": (-SECOND * 3 // 2, 0),
    }
    for name in times:
        parent = spans[name].parent
        assert parent is not None and parent.span_id == root.context.span_id
        assert spans[name].context.trace_id == root.context.trace_id


def test_a_failed_barrier_ends_in_the_phase_it_failed_in_with_its_error() -> None:
    closed = record(BarrierOutcome.FAILED, {"Update": 1.0}, error="job-actor-0 could not read the weights")
    span = tracing.barrier_span("team", "job", closed)
    assert span is not None
    spans = exported(span)

    assert set(spans) == {"lockstep.barrier", "lockstep.barrier.update", "lockstep.barrier.resume"}
    resume = spans["lockstep.barrier.resume"]
    assert (resume.start_time, resume.end_time) == (CLOSED_NS - 5 * SECOND, CLOSED_NS)
    root = spans["lockstep.barrier"]
    assert root.status.status_code is StatusCode.ERROR
    assert root.status.description == "job-actor-0 could not read the weights"


def test_an_interrupted_barrier_carries_its_reason_and_is_no_error() -> None:
    closed = record(BarrierOutcome.INTERRUPTED, {}, reason="Preempted")
    span = tracing.barrier_span("team", "job", closed)
    assert span is not None
    spans = exported(span)
    assert set(spans) == {"lockstep.barrier"}, "it finished no phase: which one it closed in is not recorded"
    root = spans["lockstep.barrier"]
    assert (root.attributes or {})["lockstep.barrier.reason"] == "Preempted"
    assert root.status.status_code is StatusCode.UNSET


def test_a_rolling_barrier_is_its_resume_phase_alone() -> None:
    span = tracing.barrier_span("team", "job", record(BarrierOutcome.COMPLETED, {"Resume": 6.0}))
    assert span is not None
    assert [(child.name, child.start_ns, child.end_ns) for child in span.children] == [
        ("lockstep.barrier.resume", CLOSED_NS - 6 * SECOND, CLOSED_NS)
    ]


def test_a_record_without_its_closing_time_makes_no_trace() -> None:
    closed = record(BarrierOutcome.COMPLETED, {"Pause": 1.0}).model_copy(update={"finished_at": None})
    assert tracing.barrier_span("team", "job", closed) is None


def pod(name: str, ack: dict[str, object] | str) -> dict[str, object]:
    text = ack if isinstance(ack, str) else document(Ack.model_validate(ack))
    return {"metadata": {"name": name, "uid": f"uid-{name}", "annotations": {BARRIER_ACK: text}}}


def timed(*steps: tuple[str, float, float]) -> dict[str, dict[str, float]]:
    """Step times ``seconds`` before the barrier closed."""
    closed = CLOSED_NS / SECOND
    return {step: {"start": closed - start, "end": closed - end} for step, start, end in steps}


def test_each_member_is_a_span_of_its_steps_at_the_times_its_pod_measured() -> None:
    pods = [
        pod(
            "job-actor-0",
            {
                "id": "uid/7",
                "phase": "Resumed",
                "loadedVersion": 7,
                "timings": timed(("stage", 6.0, 5.0), ("pause", 5.0, 4.5), ("load", 4.5, 2.0), ("resume", 1.5, 1.0)),
            },
        ),
        pod(
            "job-actor-1",
            {
                "id": "uid/7",
                "phase": "Updated",
                "error": "OSError: disk",
                "timings": timed(("stage", 6.0, 5.5), ("pause", 5.5, 5.0), ("load", 5.0, 3.0)),
            },
        ),
        pod("job-actor-2", {"id": "uid/6", "phase": "Resumed", "timings": timed(("resume", 9.0, 8.0))}),
        pod("job-actor-3", "{not json"),
        pod("job-actor-4", {"id": "uid/7", "phase": "Resumed"}),  # an agent that times nothing
    ]
    acks = tracing.barrier_acks(pods, "uid/7")
    assert set(acks) == {"job-actor-0", "job-actor-1", "job-actor-4"}, "another barrier's or unreadable: left out"
    span = tracing.barrier_span("team", "job", record(BarrierOutcome.FAILED, {"Update": 3.0}), acks)
    assert span is not None
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.emit(provider.get_tracer("test"), span)
    finished = exporter.get_finished_spans()
    root = next(s for s in finished if s.name == "lockstep.barrier")
    members = {(s.attributes or {})["k8s.pod.name"]: s for s in finished if s.name == "lockstep.barrier.member"}
    assert set(members) == {"job-actor-0", "job-actor-1"}
    for member in members.values():
        assert member.parent is not None and member.parent.span_id == root.context.span_id
    done, failed = members["job-actor-0"], members["job-actor-1"]
    assert (done.start_time, done.end_time) == (CLOSED_NS - 6 * SECOND, CLOSED_NS - SECOND)
    assert dict(done.attributes or {}) == {
        "k8s.pod.name": "job-actor-0",
        "lockstep.barrier.member.acked": "Resumed",
        "lockstep.weights.version": 7,
    }
    assert done.status.status_code is StatusCode.UNSET
    assert failed.status.status_code is StatusCode.ERROR and failed.status.description == "OSError: disk"
    steps = {
        (s.name, s.parent.span_id if s.parent else None): (
            (s.start_time or 0) - CLOSED_NS,
            (s.end_time or 0) - CLOSED_NS,
        )
        for s in finished
        if s.name.startswith("lockstep.barrier.member.")
    }
    assert steps == {
        ("lockstep.barrier.member.stage", done.context.span_id): (-6 * SECOND, -5 * SECOND),
        ("lockstep.barrier.member.pause", done.context.span_id): (-5 * SECOND, -SECOND * 9 // 2),
        ("lockstep.barrier.member.load", done.context.span_id): (-SECOND * 9 // 2, -2 * SECOND),
        ("lockstep.barrier.member.resume", done.context.span_id): (-SECOND * 3 // 2, -SECOND),
        ("lockstep.barrier.member.stage", failed.context.span_id): (-6 * SECOND, -SECOND * 11 // 2),
        ("lockstep.barrier.member.pause", failed.context.span_id): (-SECOND * 11 // 2, -5 * SECOND),
        ("lockstep.barrier.member.load", failed.context.span_id): (-5 * SECOND, -3 * SECOND),
    }


def test_no_tracer_is_set_up_without_an_endpoint() -> None:
    assert tracing.tracer({}, tracing.OPERATOR_SERVICE) is None
    assert tracing.tracer({tracing.SERVICE: "mine"}, tracing.OPERATOR_SERVICE) is None


def test_an_endpoint_sets_up_an_otlp_exporter_under_the_service_name() -> None:
    tracer = tracing.tracer({tracing.ENDPOINT: "http://127.0.0.1:1"}, tracing.OPERATOR_SERVICE)
    assert isinstance(tracer, Tracer)
    assert tracer.resource.attributes["service.name"] == tracing.OPERATOR_SERVICE
    named = tracing.tracer({tracing.TRACES_ENDPOINT: "http://127.0.0.1:1/v1/traces", tracing.SERVICE: "mine"}, "x")
    assert isinstance(named, Tracer) and named.resource.attributes["service.name"] == "mine"
