"""A real OpenTelemetry Collector on loopback for the tests (built by lockstep_e2e.build from e2e/otelcol/main.go):
an OTLP/HTTP receiver whose debug exporter writes every span it receives into the collector's log, and the spans
read back from that log."""

from __future__ import annotations

import itertools
import re
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from lockstep_e2e.build import build_otelcol
from lockstep_e2e.cluster import ClusterError, Component, free_port

CONFIG = """receivers:
  otlp:
    protocols:
      http:
        endpoint: 127.0.0.1:{port}
exporters:
  debug:
    verbosity: detailed
service:
  telemetry:
    metrics:
      level: none
  pipelines:
    traces:
      receivers: [otlp]
      exporters: [debug]
"""


@dataclass
class Span:
    """A span as the debug exporter printed it: its service, name, ids and attributes (values as printed)."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, str] = field(default_factory=dict)


@dataclass
class Collector:
    component: Component
    endpoint: str
    """What OTEL_EXPORTER_OTLP_ENDPOINT should say (OTLP/HTTP)."""

    def spans(self) -> list[Span]:
        """Every span received so far, in the order logged."""
        return parse_spans(self.component.log_path.read_text(errors="replace"))


_RESOURCE = re.compile(r"ResourceSpans #\d+")
_SERVICE = re.compile(r"-> service\.name: Str\((.*)\)")
_SPAN = re.compile(r"^Span #\d+$", re.MULTILINE)
_FIELD = re.compile(r"^\s+(Trace ID|Parent ID|ID|Name)\s*: ?(.*)$", re.MULTILINE)
_ATTRIBUTE = re.compile(r"^\s+-> ([\w.]+): \w+\((.*)\)$", re.MULTILINE)


def parse_spans(log: str) -> list[Span]:
    """The spans in a debug exporter's detailed output: each ``Span #n`` block, under the ``service.name`` of the
    ``ResourceSpans`` block it is in (its resource's attributes come before its first span)."""
    spans = []
    bounds = [*(match.start() for match in _RESOURCE.finditer(log)), len(log)]
    for start, end in itertools.pairwise(bounds):
        block = log[start:end]
        service = _SERVICE.search(block)
        for body in _SPAN.split(block)[1:]:
            fields = dict(_FIELD.findall(body))
            attributes = dict(_ATTRIBUTE.findall(body.split("Attributes:", 1)[1])) if "Attributes:" in body else {}
            spans.append(
                Span(
                    service.group(1) if service else "",
                    fields.get("Name", ""),
                    fields.get("Trace ID", ""),
                    fields.get("ID", ""),
                    fields.get("Parent ID", ""),
                    attributes,
                )
            )
    return spans


@contextmanager
def running_collector(workdir: Path, timeout: float = 60.0) -> Iterator[Collector]:
    """The collector, listening on a free loopback port once this yields; stopped after."""
    port = free_port()
    config = workdir / "otelcol.yaml"
    config.write_text(CONFIG.format(port=port))
    component = Component("otelcol", [str(build_otelcol()), f"--config={config}"], workdir / "otelcol.log")
    component.start()
    try:
        deadline = time.monotonic() + timeout
        while not _listening(port):
            component.check_alive()
            if time.monotonic() > deadline:
                raise ClusterError(f"the collector did not listen on {port} in {timeout:.0f}s:\n{component.log_tail()}")
            time.sleep(0.2)
        yield Collector(component, f"http://127.0.0.1:{port}")
    finally:
        component.stop()


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False
