"""The barrier state machine and the agents, run together under arbitrary interleavings.

Hypothesis drives a small world: actors with agents, an operator that records the barrier in a
JSON status (so every step is also an operator restart), a trainer announcing versions, and chaos:
duplicate and stale and garbage acks, pods deleted or replaced, loads that fail, agents that go
silent, and time passing beyond deadlines. Whatever happens, the world ends with every surviving
actor resumed on the newest weights, or the job failed with a reason; never an actor left paused.
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import logging
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lockstep.api import BarrierRecord, BarrierStatus, TimeoutAction
from lockstep.barrier import Member, remember, step
from lockstep.protocol import ACK_FOR, Ack, BarrierPhase, Command, TransferGroup, Weights, document, parse_ack
from lockstep_workers.agent.core import AgentCore, Staged

START = dt.datetime(2026, 11, 29, tzinfo=dt.UTC)
TIMEOUT = 30.0


def weights(version: int) -> Weights:
    return Weights(version=version, uri=f"file:///weights/v{version}", digest=f"sha256:{version:064x}")


@dataclass
class FakeStaged:
    weights: Weights
    group: TransferGroup | None
    closed: bool = False

    def close(self) -> None:
        self.closed = True


@dataclass
class FakeEngine:
    """Records what the agent asked of it; can be told to fail the next staging (a digest that does not match)
    or the next swap."""

    calls: list[str] = field(default_factory=list)
    groups: list[TransferGroup | None] = field(default_factory=list)
    fail_next: str | None = None
    """"stage" or "swap": that step raises once."""

    def _fail(self, step: str, target: Weights) -> None:
        if self.fail_next == step:
            self.fail_next = None
            raise OSError(f"{step} failed for {target.uri}")

    def pause(self) -> None:
        self.calls.append("pause")

    def stage(self, target: Weights, group: TransferGroup | None) -> FakeStaged:
        self._fail("stage", target)
        self.calls.append(f"stage {target.version}")
        return FakeStaged(target, group)

    def swap(self, staged: Staged) -> None:
        assert isinstance(staged, FakeStaged)
        self._fail("swap", staged.weights)
        self.calls.append(f"swap {staged.weights.version}")
        self.groups.append(staged.group)

    def resume(self) -> None:
        self.calls.append("resume")


@dataclass
class Pod:
    name: str
    uid: str
    agent: AgentCore
    engine: FakeEngine
    initial: int | None
    command: str | None = None
    ack: str | None = None
    silent: bool = False


SENDER = "trainer-0"


@dataclass
class World:
    on_timeout: TimeoutAction
    collective: bool = False
    rolling: bool = False
    """spec.weightSync.mode Rolling (files only): each member resumes once it swapped."""
    """The trainer sends the weights (a barrier member); new pods cannot load the committed weights alone."""
    now: dt.datetime = START
    pods: dict[str, Pod] = field(default_factory=dict)
    status: dict[str, Any] = field(default_factory=dict)
    announced: Weights | None = None
    failed: str | None = None
    uids: itertools.count[int] = field(default_factory=itertools.count)

    def committed(self) -> Weights | None:
        value = self.status.get("committed")
        return Weights.model_validate(value) if value else None

    def add_pod(self, name: str) -> None:
        engine = FakeEngine()
        agent = AgentCore(engine)
        committed = None if self.collective else self.committed()
        agent.start(committed)
        self.pods[name] = Pod(name, f"uid-{next(self.uids)}", agent, engine, committed.version if committed else None)

    def deliver(self, pod: Pod) -> None:
        """The agent sees the command on its pod and writes its ack."""
        if pod.command is None or pod.silent:
            return
        pod.ack = document(pod.agent.handle(Command.model_validate(json.loads(pod.command))))

    def member(self, pod: Pod) -> Member:
        ack = parse_ack(pod.ack)
        loaded = ack.loaded_version if isinstance(ack, Ack) and ack.loaded_version else pod.initial
        return Member(pod.name, pod.uid, loaded_version=loaded, ack=pod.ack)

    def operate(self) -> None:
        """One operator pass; the status goes through JSON, as it does through the API server."""
        if self.failed:
            return
        status = json.loads(json.dumps(self.status))
        barrier = BarrierStatus.model_validate(status["barrier"]) if status.get("barrier") else None
        history = [BarrierRecord.model_validate(r) for r in status.get("history", [])]
        decision = step(
            job_uid="job",
            barrier=barrier,
            committed=self.committed(),
            announced=self.announced,
            members=[self.member(p) for p in self.pods.values()],
            history=history,
            now=self.now,
            timeout_seconds=TIMEOUT,
            on_timeout=self.on_timeout,
            sender=SENDER if self.collective else None,
            rolling=self.rolling,
            ranks_per_member=2,
        )
        self.status = {
            "barrier": decision.barrier.model_dump(mode="json") if decision.barrier else None,
            "committed": decision.committed.model_dump(mode="json") if decision.committed else None,
            "history": [r.model_dump(mode="json") for r in remember(history, decision.record)],
        }
        for name, command in decision.commands.items():
            self.pods[name].command = json.dumps(command.model_dump(mode="json"))
        for name in decision.evict:  # the operator deletes stragglers (gone already: fine); replacements start fresh
            self.pods.pop(name, None)
            self.add_pod(name)
        if decision.failed:
            self.failed = decision.failed


actions = st.one_of(
    st.tuples(st.just("announce")),
    st.tuples(st.just("operate")),
    st.tuples(
        st.sampled_from(
            ["deliver", "redeliver", "stale", "garbage", "replace", "delete", "fail-stage", "fail-swap", "silence"]
        ),
        st.integers(0, 3),
    ),
    st.tuples(st.just("tick"), st.sampled_from([1.0, 10.0, 31.0])),
)


@settings(max_examples=400)
@given(
    actors=st.integers(1, 4),
    script=st.lists(actions, max_size=60),
    on_timeout=st.sampled_from(list(TimeoutAction)),
    collective=st.booleans(),
    rolling=st.booleans(),
)
def test_every_interleaving_ends_resumed_on_the_newest_weights_or_failed(
    actors: int, script: list[tuple[Any, ...]], on_timeout: TimeoutAction, collective: bool, rolling: bool
) -> None:
    """Filesystem or collective transport: whatever the pods (the sending trainer too) do, in any order,
    the barrier ends with every pod resumed on the newest weights, or with the job failed."""
    world = World(on_timeout, collective, rolling=rolling and not collective)
    names = [f"actor-{index}" for index in range(actors)] + ([SENDER] if collective else [])
    for name in names:
        world.add_pod(name)
    version = 0
    for action, *args in script:
        pod = world.pods.get(names[args[0] % len(names)]) if args and action != "tick" else None
        if action == "announce":
            version += 1
            world.announced = weights(version)
        elif action == "operate":
            world.operate()
        elif action == "tick":
            world.now += dt.timedelta(seconds=args[0])
        elif pod is None:
            if action == "replace":  # a deleted pod comes back (the operator recreates it)
                world.add_pod(names[args[0] % len(names)])
        elif action in ("deliver", "redeliver"):
            world.deliver(pod)
        elif action == "stale":
            pod.ack = document(Ack(id="job/0/1", phase="Resumed", loaded_version=0))
        elif action == "garbage":
            pod.ack = "{not json"
        elif action == "replace":
            del world.pods[pod.name]
            world.add_pod(pod.name)
        elif action == "delete":
            del world.pods[pod.name]
        elif action in ("fail-stage", "fail-swap"):
            pod.engine.fail_next = action.removeprefix("fail-")
        elif action == "silence":
            pod.silent = True

    # Drain: pods come back, the silent ones stay silent; time passes; everyone answers.
    for name in names:
        if name not in world.pods:
            world.add_pod(name)
    for _ in range(60):
        world.operate()
        for pod in list(world.pods.values()):
            world.deliver(pod)
        world.now += dt.timedelta(seconds=TIMEOUT / 2)

    if world.failed:
        assert "weight update to version" in world.failed
        return
    assert world.status.get("barrier") is None, "the barrier must close"
    newest = world.announced.version if world.announced else None
    committed = world.committed()
    assert (committed.version if committed else None) == newest
    for pod in world.pods.values():
        assert not pod.agent.paused, f"{pod.name} was left paused"
        assert_ordered(pod, collective)
        if pod.name == SENDER:
            assert all(group.rank_offset == 0 for group in pod.engine.groups if group is not None)
            continue
        loaded = pod.agent.loaded.version if pod.agent.loaded else None
        assert loaded == newest, f"{pod.name} serves version {loaded}, not {newest}"
        if collective:
            assert all(g is not None and g.rank_offset > 0 for g in pod.engine.groups), "received only from the sender"


def assert_ordered(pod: Pod, collective: bool) -> None:
    """Per barrier the engine saw: the version staged (generating still), pause, at most one swap of what was
    staged last (with a collective backend, one per attempt at the transfer), then resume; a swap while serving
    happens only at start, before the pod is ready."""
    paused = False
    staged = None
    swaps_since_pause = 0
    calls = pod.engine.calls
    for position, call in enumerate(calls):
        if call == "pause":
            assert not paused, f"{pod.name} paused twice: {calls}"
            paused, swaps_since_pause = True, 0
        elif call == "resume":
            assert paused, f"{pod.name} resumed without a pause: {calls}"
            paused = False
        elif call.startswith("stage "):
            staged = call.removeprefix("stage ")
        else:
            assert call == f"swap {staged}", f"{pod.name} swapped in what it did not stage last: {calls}"
            assert paused or position == 1, f"{pod.name} swapped while serving: {calls}"
            swaps_since_pause += 1
            assert collective or swaps_since_pause <= 1, f"{pod.name} swapped twice in one barrier: {calls}"


def test_a_redelivered_command_is_acked_again_but_not_repeated() -> None:
    engine = FakeEngine()
    agent = AgentCore(engine)
    for phase in BarrierPhase:
        command = Command(id="job/1/1", version=1, uri="u", digest="d", phase=phase)
        first = agent.handle(command)
        assert agent.handle(command) == first
        assert first.phase == ACK_FOR[phase]
    assert engine.calls == ["pause", "stage 1", "swap 1", "resume"], "a Pause command pauses before anything"


def test_a_failed_command_is_carried_out_again_only_when_asked_again(caplog: pytest.LogCaptureFixture) -> None:
    """A staging that fails (its digest does not match, say) is this member's error alone, and it fails before
    the pause: the member goes on generating under its old weights until the operator asks again."""
    engine = FakeEngine(fail_next="stage")
    agent = AgentCore(engine)
    update = Command(id="job/1/1", version=1, uri="u", digest="d", phase=BarrierPhase.UPDATE)
    with caplog.at_level(logging.INFO, logger="lockstep.agent"):
        failed = agent.handle(update)
    assert failed.error is not None and failed.retry == 0
    assert [r.getMessage() for r in caplog.records] == [
        f"barrier job/1/1, phase Update failed on this pod ({failed.error}); "
        "the operator retries it or replaces this member"
    ], "one line that says what failed, without a traceback"
    assert agent.handle(update) == failed, "the same try is acked again, not repeated"
    retried = agent.handle(update.model_copy(update={"retry": 1}))
    assert retried.error is None and retried.retry == 1 and retried.loaded_version == 1
    assert engine.calls == ["stage 1", "pause", "swap 1"], "never paused for the staging that failed"


def test_a_staged_copy_is_freed_once_its_ack_is_written_and_always_before_the_next_staging() -> None:
    agent = AgentCore(FakeEngine())
    agent.handle(Command(id="job/1/1", version=1, uri="u1", digest="d1", phase=BarrierPhase.UPDATE))
    first = agent.swapped
    assert isinstance(first, FakeStaged) and not first.closed, "held while the ack is written, not in the pause"
    agent.release()
    assert agent.releasing is not None
    agent.releasing.join()
    assert first.closed and agent.swapped is None
    agent.handle(Command(id="job/2/1", version=2, uri="u2", digest="d2", phase=BarrierPhase.UPDATE))
    second = agent.swapped
    agent.handle(Command(id="job/3/1", version=3, uri="u3", digest="d3", phase=BarrierPhase.RESUME))
    assert isinstance(second, FakeStaged) and second.closed, "no release came between: freed before staging again"
    assert isinstance(agent.swapped, FakeStaged) and agent.swapped.weights.version == 3


def test_weights_the_member_holds_are_not_staged_again_whatever_size_their_announcement_gave() -> None:
    """The initial weights come from the committed document (with its size); a command names no size."""
    engine = FakeEngine()
    agent = AgentCore(engine)
    agent.start(weights(1).model_copy(update={"bytes": 4096}))
    held = weights(1)
    agent.handle(Command(id="job/1/1", version=1, uri=held.uri, digest=held.digest, phase=BarrierPhase.RESUME))
    assert engine.calls == ["stage 1", "swap 1", "pause", "resume"], "started on it: paused and resumed only"


def test_a_failed_swap_leaves_the_member_paused_on_its_old_weights_until_asked_again() -> None:
    engine = FakeEngine(fail_next="swap")
    agent = AgentCore(engine)
    update = Command(id="job/1/1", version=1, uri="u", digest="d", phase=BarrierPhase.UPDATE)
    failed = agent.handle(update)
    assert failed.error is not None and failed.loaded_version is None and agent.paused
    retried = agent.handle(update.model_copy(update={"retry": 1}))
    assert retried.error is None and retried.loaded_version == 1
    assert engine.calls == ["stage 1", "pause", "stage 1", "swap 1"], "staged again, paused once"


def test_a_member_has_resumed_a_version_only_once_it_acked_resumed_for_it() -> None:
    """What the sending trainer waits for before it stops its agent: its own part in the last barrier."""
    agent = AgentCore(FakeEngine())
    update = Command(id="job/2/1", version=2, uri="u", digest="d", phase=BarrierPhase.UPDATE)
    agent.handle(update)
    assert not agent.resumed(2), "loaded, not resumed yet"
    agent.handle(update.model_copy(update={"phase": BarrierPhase.RESUME}))
    assert agent.resumed(2) and agent.resumed(1) and not agent.resumed(3)


def test_every_ack_carries_the_times_of_the_steps_taken_in_its_barrier_a_failed_one_included() -> None:
    engine = FakeEngine(fail_next="swap")
    agent = AgentCore(engine)
    update = Command(id="job/1/1", version=1, uri="u", digest="d", phase=BarrierPhase.UPDATE)
    failed = agent.handle(update)
    assert set(failed.timings) == {"stage", "pause", "load"}, "the swap that raised is timed too"
    updated = agent.handle(update.model_copy(update={"retry": 1}))
    assert updated.timings["load"].start >= failed.timings["load"].end, "a retried step: its last try"
    resumed = agent.handle(update.model_copy(update={"phase": BarrierPhase.RESUME}))
    steps = sorted(resumed.timings.items(), key=lambda item: item[1].start)
    assert [step for step, _ in steps] == ["pause", "stage", "load", "resume"], "paused once, before the retry"
    assert all(times.start <= times.end for _, times in steps)
    assert parse_ack(document(resumed)) == resumed, "the timings survive the annotation"
    nxt = agent.handle(Command(id="job/2/1", version=2, uri="u2", digest="d2", phase=BarrierPhase.RESUME))
    assert set(nxt.timings) == {"stage", "pause", "load", "resume"}
    assert nxt.timings["stage"].start >= resumed.timings["resume"].end, "a new barrier starts with no times"
