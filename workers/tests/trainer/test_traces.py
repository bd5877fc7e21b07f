"""Trainer rank 0's step traces (lockstep_workers.trainer.traces), read back from the OpenTelemetry SDK's in-memory
exporter: the step's span and its parts at their measured times, as the trainer's background publish emits them."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Tracer

from lockstep import tracing
from lockstep.api import Training
from lockstep_workers.trainer import traces
from lockstep_workers.trainer.loop import _publish_and_announce
from lockstep_workers.trainer.pod import PodEnvironment
from lockstep_workers.weights.files import StreamedPublish

SECOND = 10**9
STARTED = 1_800_000_000.0
METRICS = {
    "rollout_wait_seconds": 2.0,
    "learn_seconds": 3.0,
    "publish_gather_seconds": 0.5,
    "publish_wait_seconds": 0.25,
    "publish_seconds": 1.5,
    "reward": 0.75,
    "staleness": 1.0,
    "clamp_log_ratio_new_old_indicator": 0.0,
    "kl_new_old": 0.0,
    "ess": 1.0,
}


def written(env: PodEnvironment, version: int, whole: dict[str, torch.Tensor]) -> StreamedPublish:
    """``whole`` handed over to a publish of ``version``, as the trainer's thread hands over its layers."""
    writing = StreamedPublish(whole, env.weights_dir, version, keep=3)
    writing.put(whole)
    writing.close()
    return writing


def in_memory() -> tuple[Tracer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("test"), exporter


def by_name(exporter: InMemorySpanExporter) -> dict[str, ReadableSpan]:
    return {span.name: span for span in exporter.get_finished_spans()}


def test_a_step_is_one_trace_with_its_parts_at_their_measured_times() -> None:
    tracer, exporter = in_memory()
    starts = {"sampling_wait": STARTED + 1, "learn": STARTED + 3, "gather": STARTED + 6, "publish": STARTED + 7}
    tracing.emit(tracer, traces.step_span(4, STARTED, 7.0, starts, METRICS, "job-trainer-0", "team"))
    spans = by_name(exporter)

    root = spans["lockstep.step"]
    start = int(STARTED * SECOND)
    assert (root.start_time, root.end_time, root.parent) == (start, start + 7 * SECOND, None)
    assert dict(root.attributes or {}) == {
        "k8s.pod.name": "job-trainer-0",
        "k8s.namespace.name": "team",
        "lockstep.step.number": 4,
        "lockstep.weights.version": 4,
        "lockstep.step.publish_wait_seconds": 0.25,
        "lockstep.step.reward": 0.75,
        "lockstep.step.staleness": 1.0,
    }
    parts = {
        name.removeprefix("lockstep.step."): ((span.start_time or 0) - start, (span.end_time or 0) - start)
        for name, span in spans.items()
        if span is not root
    }
    assert parts == {
        "sampling_wait": (1 * SECOND, 3 * SECOND),
        "learn": (3 * SECOND, 6 * SECOND),
        "gather": (6 * SECOND, 6 * SECOND + SECOND // 2),
        "publish": (7 * SECOND, 8 * SECOND + SECOND // 2),
    }
    assert all(
        (span.parent is not None and span.parent.span_id) == root.context.span_id
        for span in spans.values()
        if span is not root
    )


def test_a_part_without_its_start_or_its_time_has_no_span() -> None:
    tracer, exporter = in_memory()
    metrics = {key: value for key, value in METRICS.items() if key != "learn_seconds"}
    tracing.emit(tracer, traces.step_span(1, STARTED, 5.0, {"sampling_wait": STARTED, "learn": STARTED}, metrics))
    spans = by_name(exporter)
    assert set(spans) == {"lockstep.step", "lockstep.step.sampling_wait"}
    assert "k8s.pod.name" not in (spans["lockstep.step"].attributes or {})


def test_the_trainers_publish_emits_the_steps_trace_and_nothing_without_a_tracer(tmp_path: Path) -> None:
    env = PodEnvironment(0, 1, [], tmp_path, None, None, None, 0)
    settings = Training(reward="lockstep_workers.rewards:target_words")
    whole = {"weight": torch.zeros(2)}
    tracer, exporter = in_memory()
    started = time.time() - 6.0  # the step handed its publish over just now
    starts = {"sampling_wait": started, "learn": started + 2, "gather": started + 5}
    _publish_and_announce(env, settings, 1, written(env, 1, whole), METRICS, 6.0, 1.0, trace=(tracer, started, starts))
    spans = by_name(exporter)
    assert set(spans) == {"lockstep.step", *(f"lockstep.step.{part}" for part in traces.STEP_PARTS)}
    publish = spans["lockstep.step.publish"]
    assert publish.start_time is not None and publish.start_time >= int((started + 6) * SECOND)  # when it began
    recorded = json.loads(env.metrics_file.read_text().splitlines()[-1])  # the publish's own time
    assert publish.end_time == publish.start_time + round(recorded["publish_seconds"] * SECOND)

    _publish_and_announce(env, settings, 2, written(env, 2, whole), METRICS, 6.0, 1.0)
    assert len(exporter.get_finished_spans()) == len(spans)
