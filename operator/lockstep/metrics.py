"""The operator's Prometheus metrics (served with ``--metrics-port``)."""

from __future__ import annotations

import contextlib

from prometheus_client import Counter, Gauge, Histogram

from lockstep import barrier
from lockstep.api import BarrierRecord, Phase, RLJobStatus

RECONCILE_SECONDS = Histogram("lockstep_reconcile_duration_seconds", "Time of one reconcile pass of an RLJob.")
RECONCILE_ERRORS = Counter("lockstep_reconcile_errors_total", "Reconcile passes that ended in an error.")
BARRIERS = Counter("lockstep_barriers_total", "Weight-update barriers that closed, by outcome.", ["outcome"])
BARRIER_PHASE_SECONDS = Histogram(
    "lockstep_barrier_phase_duration_seconds",
    "Time of one phase of a weight-update barrier, from command to the last member's ack.",
    ["phase"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
)
JOBS = Gauge("lockstep_rljobs", "RLJobs by phase, as this operator last saw them.", ["phase"])
PARITY_LOCKED = Gauge(
    "lockstep_parity_locked", "1 when the job's ParityLocked condition is True, else 0.", ["namespace", "rljob"]
)
WEIGHTS_LAG = Gauge(
    "lockstep_weights_lag", "Newest announced weights version minus the oldest an actor serves.", ["namespace", "rljob"]
)

_phases: dict[tuple[str, str], str] = {}


def record(namespace: str, name: str, old: RLJobStatus, new: RLJobStatus) -> None:
    """Update the metrics from one pass's status change."""
    _phases[(namespace, name)] = new.phase.value
    _count_phases()
    parity = next((c for c in new.conditions if c.type == "ParityLocked"), None)
    PARITY_LOCKED.labels(namespace, name).set(1 if parity is not None and parity.status.value == "True" else 0)
    if new.lag is not None:
        WEIGHTS_LAG.labels(namespace, name).set(new.lag)
    for closed in barrier.closed_since(old.barrier_history, new.barrier_history):
        _barrier(closed)


def forget(namespace: str, name: str) -> None:
    """The job is gone: drop its series."""
    _phases.pop((namespace, name), None)
    _count_phases()
    for gauge in (PARITY_LOCKED, WEIGHTS_LAG):
        with contextlib.suppress(KeyError):
            gauge.remove(namespace, name)


def _barrier(closed: BarrierRecord) -> None:
    BARRIERS.labels(closed.outcome.value).inc()
    for phase, seconds in closed.phase_seconds.items():
        BARRIER_PHASE_SECONDS.labels(phase).observe(seconds)


def _count_phases() -> None:
    for phase in Phase:
        JOBS.labels(phase.value).set(sum(1 for value in _phases.values() if value == phase.value))
