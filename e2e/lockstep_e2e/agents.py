"""Barrier agents for end-to-end tests and benchmarks: the real PodAgent on a recording engine,
one thread per pod, each with a token bound to its pod (as the kubelet would mount it), writing
real acks on the real API server."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from kubernetes import client

from lockstep.protocol import TransferGroup, Weights
from lockstep_e2e.install import pod_client
from lockstep_workers.agent.core import AgentCore, Staged
from lockstep_workers.agent.pod_agent import PodAgent

STEPS = ("stage", "pause", "swap", "resume")


@dataclass(frozen=True)
class RecordedStaging:
    weights: Weights

    def close(self) -> None:
        pass


class AgentKilled(BaseException):
    """Ends a killed agent's thread where it stands (not an Exception: the agent acks nothing for it)."""


@dataclass
class RecordingEngine:
    """Records what the agent asked of it. Clearing ``gates[step]`` (one of STEPS) makes that step wait until the
    gate is set again: a slow actor. ``waiting`` is the step it waits in, if any."""

    calls: list[str] = field(default_factory=list)
    gates: dict[str, threading.Event] = field(default_factory=lambda: {s: _set(threading.Event()) for s in STEPS})
    waiting: str | None = None
    killed: threading.Event = field(default_factory=threading.Event)

    def kill(self) -> None:
        """kill -9 of the actor: its agent stops in the step it waits in (or the next it reaches), never to act
        or ack again."""
        self.killed.set()
        for gate in self.gates.values():
            gate.set()

    def pause(self) -> None:
        self._step("pause")
        self.calls.append("pause")

    def stage(self, weights: Weights, group: TransferGroup | None) -> RecordedStaging:
        self._step("stage")
        self.calls.append(f"stage {weights.version}")
        return RecordedStaging(weights)

    def swap(self, staged: Staged) -> None:
        assert isinstance(staged, RecordedStaging)
        self._step("swap")
        self.calls.append(f"swap {staged.weights.version}")

    def resume(self) -> None:
        self._step("resume")
        self.calls.append("resume")

    def _step(self, step: str) -> None:
        self.waiting = step
        self.gates[step].wait()
        self.waiting = None
        if self.killed.is_set():
            raise AgentKilled(step)


def _set(event: threading.Event) -> threading.Event:
    event.set()
    return event


@contextlib.contextmanager
def running_agents(api: client.ApiClient, namespace: str, pods: list[str]) -> Iterator[dict[str, RecordingEngine]]:
    """An agent thread per pod for the duration of the block (or until its engine is killed); yields each pod's
    engine."""
    stop = threading.Event()
    engines = {pod: RecordingEngine() for pod in pods}
    threads = []
    for pod, engine in engines.items():
        agent = PodAgent(AgentCore(engine), client.CoreV1Api(pod_client(api, namespace, pod)), namespace, pod)
        agent.start()
        thread = threading.Thread(target=_run_until_killed, args=(agent, stop), name=f"agent-{pod}", daemon=True)
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


def _run_until_killed(agent: PodAgent, stop: threading.Event) -> None:
    with contextlib.suppress(AgentKilled):
        agent.run(stop, 2)
