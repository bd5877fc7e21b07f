"""What the benchmarks share: the operator's peak memory, its API requests, and how results are written."""

from __future__ import annotations

import datetime as dt
import json
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import psutil
from kubernetes import client

from lockstep.keys import OPERATOR_USERNAME
from lockstep_e2e.cluster import LocalCluster
from lockstep_e2e.install import install, start_operator


class PeakRss:
    """Samples a process's resident memory in the background; ``peak`` is the highest seen (bytes)."""

    def __init__(self, pid: int, interval: float = 0.1) -> None:
        self.process = psutil.Process(pid)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, args=(interval,), daemon=True)
        self._thread.start()

    def _sample(self, interval: float) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, self.process.memory_info().rss)
            except psutil.NoSuchProcess:
                return
            time.sleep(interval)

    def reset(self) -> None:
        self.peak = 0

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def operator_requests_since(cluster: LocalCluster, since: dt.datetime) -> int:
    """Requests the operator sent after ``since`` (its watches count once, when they started)."""
    count = 0
    for event in cluster.audit_events():
        if event["user"]["username"] != OPERATOR_USERNAME or event["stage"] != "ResponseComplete":
            continue
        received = dt.datetime.fromisoformat(event["requestReceivedTimestamp"].replace("Z", "+00:00"))
        if received >= since and event["verb"] != "watch":
            count += 1
    return count


@contextmanager
def operator_lab() -> Iterator[tuple[LocalCluster, client.ApiClient, PeakRss]]:
    """A cluster with room for 4400 pods, Lockstep installed, the operator running with its memory sampled."""
    workdir = Path(tempfile.mkdtemp(prefix="lockstep-bench-"))
    with LocalCluster(workdir, nodes=4, node_pods=1100) as cluster:
        api = cluster.api_client()
        install(api)
        operator = start_operator(cluster, workdir / "operator.log")
        assert operator.process is not None
        rss = PeakRss(operator.process.pid)
        try:
            yield cluster, api, rss
        finally:
            rss.stop()
            operator.stop()


def write_results(path: Path, results: list[Any]) -> None:
    """Write the dataclass results as JSON and say where."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")
    print(f"wrote {path}")
