"""Barrier agents for end-to-end tests and benchmarks: the real PodAgent on a recording engine,
one thread per pod, each with a token bound to its pod (as the kubelet would mount it), writing
real acks on the real API server."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from kubernetes import client

from lockstep.protocol import TransferGroup, Weights
from lockstep_e2e.install import pod_client
from lockstep_workers.agent import AgentCore, PodAgent, Staged

STEPS = ("stage", "pause", "swap", "resume")


@dataclass(frozen=True)
class RecordedStaging:
    weights: Weights

    def close(self) -> None:
        pass


@dataclass
class RecordingEngine:
    """Records what the agent asked of it. Clearing ``gates[step]`` (one of STEPS) makes that step wait until the
    gate is set again: a slow actor."""

    calls: list[str] = field(default_factory=list)
    gates: dict[str, threading.Event] = field(default_factory=lambda: {s: _set(threading.Event()) for s in STEPS})

    def pause(self) -> None:
        self.gates["pause"].wait()
        self.calls.append("pause")

    def stage(self, weights: Weights, group: TransferGroup | None) -> RecordedStaging:
        self.gates["stage"].wait()
        self.calls.append(f"stage {weights.version}")
        return RecordedStaging(weights)

    def swap(self, staged: Staged) -> None:
        assert isinstance(staged, RecordedStaging)
        self.gates["swap"].wait()
        self.calls.append(f"swap {staged.weights.version}")

    def resume(self) -> None:
        self.gates["resume"].wait()
        self.calls.append("resume")


def _set(event: threading.Event) -> threading.Event:
    event.set()
    return event


@contextmanager
def running_agents(api: client.ApiClient, namespace: str, pods: list[str]) -> Iterator[dict[str, RecordingEngine]]:
    """An agent thread per pod for the duration of the block; yields each pod's engine."""
    stop = threading.Event()
    engines = {pod: RecordingEngine() for pod in pods}
    threads = []
    for pod, engine in engines.items():
        agent = PodAgent(AgentCore(engine), client.CoreV1Api(pod_client(api, namespace, pod)), namespace, pod)
        agent.start()
        thread = threading.Thread(target=agent.run, args=(stop, 2), name=f"agent-{pod}", daemon=True)
        thread.start()
        threads.append(thread)
    try:
        yield engines
    finally:
        stop.set()
        for engine in engines.values():
            for gate in engine.gates.values():
                gate.set()
        for thread in threads:
            thread.join(timeout=10)
