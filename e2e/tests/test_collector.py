"""The tests' OpenTelemetry Collector receives what Lockstep's tracer exports, and lockstep_e2e.collector reads each
span back from its log: service, name, ids, parent and attributes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lockstep import tracing
from lockstep.tracing import SpanData
from lockstep_e2e.collector import running_collector
from lockstep_e2e.fixtures import wait_for


def test_the_collector_logs_each_span_lockstep_exports_and_they_are_read_back_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with running_collector(tmp_path) as collector:
        monkeypatch.setenv(tracing.ENDPOINT, collector.endpoint)  # where the exporter sends, as in a pod
        tracer = tracing.tracer(os.environ, "lockstep-test")
        assert tracer is not None
        child = SpanData("lockstep.barrier.update", 1_000, 2_000)
        attributes = {"lockstep.job": "tiny", "lockstep.weights.version": 3, "lockstep.barrier.evicted": ["a", "b"]}
        tracing.emit(tracer, SpanData("lockstep.barrier", 0, 3_000, attributes, "it failed", [child]))
        wait_for(lambda: len(collector.spans()) == 2, "the collector to log both spans (a batch leaves in 5 s)")
    root, update = sorted(collector.spans(), key=lambda span: span.name)
    assert (root.service, root.name, update.name) == ("lockstep-test", "lockstep.barrier", "lockstep.barrier.update")
    assert update.trace_id == root.trace_id and update.parent_id == root.span_id and not root.parent_id
    assert root.attributes["lockstep.job"] == "tiny" and root.attributes["lockstep.weights.version"] == "3"
    assert "lockstep.barrier.evicted" in root.attributes and not update.attributes
