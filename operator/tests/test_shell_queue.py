"""The shell's work queue with its World and Applier (lockstep.controller.Shell: running, dirty, the ack gate,
the pod cache), driven one step at a time on one thread: a fake answers the few client calls a pass makes, and a
weights announcement is delivered at every point of a pass that closes a barrier (issue 21 item 8: a lost wake-up)."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest
from kubernetes import client
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from factories import job, policy
from fake_clients import HookedLock
from lockstep import keys
from lockstep.controller import Shell
from lockstep.events import PassScope
from reconcile_helpers import announce, carry_barrier, settle

NAMESPACE, JOB = "team-a", "demo"


class Answer:
    """An answer read with ``_preload_content=False``."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.data = json.dumps(body).encode()

    def drain_conn(self) -> None:
        pass

    def release_conn(self) -> None:
        pass


class Inline:
    """An executor that runs each task at once, on the caller's thread."""

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        fn(*args)

    def map(self, fn: Callable[[Any], Any], items: Iterable[Any]) -> Iterator[Any]:
        return iter([fn(item) for item in items])


class World:
    """The job and its pods as the API server holds them, and what the operator wrote."""

    def __init__(self, body: dict[str, Any], pods: list[dict[str, Any]], hook: Callable[[], None]) -> None:
        self.revision = 100
        self.job = {**body, "metadata": {**body["metadata"], "resourceVersion": self.bump()}}
        self.pods = {p["metadata"]["name"]: self.stamped(p) for p in pods}
        self.hook = hook

    def bump(self) -> str:
        self.revision += 1
        return str(self.revision)

    def stamped(self, pod: dict[str, Any]) -> dict[str, Any]:
        copy: dict[str, Any] = json.loads(json.dumps(pod))
        copy["metadata"]["resourceVersion"] = self.bump()
        copy["metadata"]["labels"][keys.MANAGED_BY] = keys.MANAGER
        return copy

    def annotated(self, name: str, values: dict[str, str]) -> dict[str, Any]:
        """What a patch of the pod's annotations (by the operator or by the pod itself) leaves."""
        pod = self.pods[name]
        pod["metadata"]["annotations"] = {**pod["metadata"]["annotations"], **values}
        self.pods[name] = self.stamped(pod)
        return self.pods[name]

    def call(self, method: str, *args: Any, **_: Any) -> Answer:
        self.hook()
        if method == "patch_namespaced_pod":
            name, _namespace, body = args
            return Answer(self.annotated(name, body["metadata"]["annotations"]))
        if method == "patch_namespaced_custom_object_status":
            body = args[5]
            assert body["metadata"]["resourceVersion"] == self.job["metadata"]["resourceVersion"]
            status = _merged(self.job.get("status") or {}, body["status"])
            metadata = {**self.job["metadata"], "resourceVersion": self.bump()}
            self.job = {**self.job, "status": status, "metadata": metadata}
            return Answer(self.job)
        return Answer({})  # the children's server-side applies, the Events


class Fake:
    """The kubernetes client API objects of the shell (core, custom, rbac, networking)."""

    def __init__(self, world: World) -> None:
        self.world = world

    def __getattr__(self, method: str) -> Callable[..., Answer]:
        return lambda *args, **options: self.world.call(method, *args, **options)


def _merged(old: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """``old`` with the JSON merge patch applied."""
    merged = dict(old)
    for key, value in patch.items():
        if value is None:
            merged.pop(key, None)
        elif isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merged(merged[key], value)
        else:
            merged[key] = value
    return merged


class Run:
    """One job whose barrier to version 3 waits for its last Resumed ack, in a shell whose every step can be
    interleaved with a delivery."""

    def __init__(self, deliver_at: int | None = None) -> None:
        self.points = 0
        self.deliver_at = deliver_at
        self.delivered = False
        self.counting = False
        body, pods = settle(job())
        announce(pods[2], 3)
        body, _ = carry_barrier(body, pods, 3, now=dt.datetime.now(dt.UTC))  # in Resume: both actors acked it
        self.last_ack = pods[1]["metadata"]["annotations"].pop(keys.BARRIER_ACK)
        assert body["status"]["barrier"]["phase"] == "Resume"
        self.world = World({**body, "metadata": {**body["metadata"]}}, pods, self.point)
        self.timers: list[float] = []
        shell = Shell(client.ApiClient())
        kube = shell.kube
        kube.core = kube.custom = kube.rbac = kube.networking = Fake(self.world)  # type: ignore[assignment]
        shell._passes = shell.applier._pod_writers = Inline()  # type: ignore[assignment]
        for part in (shell.world, shell.queue, shell.applier):
            part._guard = HookedLock(self.point)  # type: ignore[assignment]
        shell.queue.wake_in = lambda _key, seconds: self.timers.append(seconds)  # type: ignore[method-assign]
        shell.world._policies = {"default": policy()}
        shell.world._namespaces[NAMESPACE] = {"metadata": {"name": NAMESPACE, "labels": {}}}
        self.shell = shell
        with self.quiet():
            shell.job_event(NAMESPACE, JOB, json.loads(json.dumps(self.world.job)))
            shell.pods_listed(list(self.world.pods.values()), str(self.world.revision))  # a whole pass
        assert shell.world._gates[NAMESPACE, JOB].waiting == {pods[1]["metadata"]["name"]}, (
            "Resume waits for the last ack"
        )

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """Within it, no point counts and nothing is delivered."""
        counting, self.counting = self.counting, False
        try:
            yield
        finally:
            self.counting = counting

    def point(self) -> None:
        """A step of the pass that closes the barrier: the announcement comes here if this is its point."""
        if not self.counting:
            return
        self.points += 1
        if self.points == self.deliver_at:
            self.announce()

    def announce(self) -> None:
        """Trainer rank 0 announces version 4 (its patch, as the pod watch delivers it)."""
        with self.quiet():
            self.delivered = True
            trainer = f"{JOB}-trainer-0"
            weights = json.loads(self.world.pods[trainer]["metadata"]["annotations"][keys.WEIGHTS])
            weights.update(version=4, uri=weights["uri"].replace("v3", "v4"), digest="sha256:4")
            pod = self.world.annotated(trainer, {keys.WEIGHTS: json.dumps(weights)})
            self.shell.pod_event(NAMESPACE, JOB, "MODIFIED", json.loads(json.dumps(pod)))

    def close(self) -> None:
        """The last member acks Resume: the gate asks for a pass of the barrier step alone, which closes it."""
        actor = f"{JOB}-actor-1"
        pod = self.world.annotated(actor, {keys.BARRIER_ACK: self.last_ack})
        self.counting = True
        self.shell.pod_event(NAMESPACE, JOB, "MODIFIED", json.loads(json.dumps(pod)))
        self.counting = False


def _points_of_a_closing_pass() -> int:
    run = Run()
    run.close()
    assert run.world.job["status"]["weightsVersion"] == 3 and "barrier" not in run.world.job["status"]
    return run.points


def test_a_closing_pass_alone_leaves_no_barrier_open_and_no_wake_up_behind() -> None:
    assert _points_of_a_closing_pass() > 5


def test_the_pass_that_closes_a_barrier_emits_its_trace_once() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    run = Run()
    run.shell.tracer = provider.get_tracer("test")
    run.close()
    run.shell.request(NAMESPACE, JOB)  # a later pass closes nothing
    spans = {span.name: span for span in exporter.get_finished_spans()}
    assert len(exporter.get_finished_spans()) == len(spans) == 3
    root = spans["lockstep.barrier"]
    attributes = root.attributes or {}
    assert (attributes["lockstep.weights.version"], attributes["lockstep.barrier.outcome"]) == (3, "Completed")
    assert (attributes["k8s.namespace.name"], attributes["lockstep.job"]) == (NAMESPACE, JOB)
    phases = ["lockstep.barrier.update", "lockstep.barrier.resume"]  # a barrier opens in Update
    assert [spans[name].context.trace_id for name in phases] == [root.context.trace_id] * 2


@pytest.mark.parametrize("point", [0, *range(1, _points_of_a_closing_pass() + 2)])
def test_an_announcement_at_any_point_of_a_pass_closing_a_barrier_opens_the_next_without_a_timer(point: int) -> None:
    """Point 0: while the barrier's last phase waits for its last ack (the pass it asks for finds the barrier
    open); then after each release of the shell's guard and before each client call of the closing pass; the
    last point, once the pass ended."""
    run = Run(deliver_at=point)
    if point == 0:
        run.announce()
    run.close()
    if not run.delivered:
        run.announce()
    status = run.world.job["status"]
    assert status["weightsVersion"] == 3
    assert status.get("barrier", {}).get("version") == 4, (
        f"announced at point {point}, version 4 waits for a timer ({run.timers} s) or another event"
    )
    assert run.shell.queue._running == set() and run.shell.queue._dirty == {}, "the queue is left idle"
    assert run.shell.world._gates[NAMESPACE, JOB].phase.value == "Update"


def test_the_announcement_is_never_taken_for_the_operators_own_write() -> None:
    """The echo of the operator's own command asks for no pass; the trainer's patch on top of it asks for one."""
    run = Run()
    shell = run.shell
    trainer = f"{JOB}-trainer-0"
    echo = json.loads(json.dumps(shell.world._pods[NAMESPACE, JOB].pods[trainer]))
    echo["metadata"]["resourceVersion"] = run.world.bump()
    passes: list[PassScope] = []
    shell.request_soon = lambda _namespace, _name, scope=PassScope.FULL: passes.append(scope)  # type: ignore[method-assign]
    shell.pod_event(NAMESPACE, JOB, "MODIFIED", echo)
    assert passes == []
    announced = json.loads(json.dumps(echo))
    announced["metadata"]["annotations"][keys.WEIGHTS] = "{}"
    announced["metadata"]["resourceVersion"] = run.world.bump()
    shell.pod_event(NAMESPACE, JOB, "MODIFIED", announced)
    assert passes == [PassScope.FULL]
