"""The barrier state machine, one situation at a time (the interleavings are in
workers/tests/agent/test_core.py)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st

from factories import NOW
from lockstep import keys
from lockstep.api import BarrierOutcome, BarrierRecord, BarrierStatus, TimeoutAction
from lockstep.barrier import (
    HISTORY_LENGTH,
    MEMBER_RETRIES,
    STALL_AFTER_FAILURES,
    Decision,
    Member,
    held_back,
    interrupt,
    member_of,
    remember,
    step,
)
from lockstep.protocol import PROTOCOL, Ack, BarrierPhase, Weights, document
from lockstep.times import rfc3339

V1 = Weights(version=1, uri="file:///w/v1", digest="sha256:1", bytes=4096)
V2 = Weights(version=2, uri="file:///w/v2", digest="sha256:2")


def ack(barrier: BarrierStatus, phase: str, **extra: object) -> str:
    return json.dumps(Ack(id=barrier.id, phase=phase, **extra).model_dump(mode="json", by_alias=True))  # type: ignore[arg-type]


def members(acks: dict[str, str | None], loaded: int | None = None) -> list[Member]:
    return [Member(name, f"uid-{name}", loaded, text) for name, text in acks.items()]


def run(
    barrier: BarrierStatus | None,
    acks: dict[str, str | None] | list[Member],
    *,
    seconds: float = 0,
    on_timeout: TimeoutAction = TimeoutAction.FAIL_JOB,
    committed: Weights | None = None,
    announced: Weights | None = V1,
    loaded: int | None = None,
    sender: str | None = None,
    rolling: bool = False,
) -> Decision:
    return step(
        job_uid="job",
        barrier=barrier,
        committed=committed,
        announced=announced,
        members=acks if isinstance(acks, list) else members(acks, loaded),
        history=[],
        now=NOW + dt.timedelta(seconds=seconds),
        timeout_seconds=30,
        on_timeout=on_timeout,
        sender=sender,
        ranks_per_member=2,
        rolling=rolling,
    )


def test_announced_weights_open_a_barrier_that_updates_every_member() -> None:
    decision = run(None, {"a": None, "b": None})
    assert decision.barrier is not None and decision.barrier.id == "job/1/1"
    assert {name: c.phase for name, c in decision.commands.items()} == {
        "a": BarrierPhase.UPDATE,
        "b": BarrierPhase.UPDATE,
    }, "protocol 2: each member pauses, then loads, on one command"
    assert run(None, {"a": None}, committed=V1, loaded=1).barrier is None, "nothing newer than committed: no barrier"


def test_phases_advance_only_when_every_member_acked_and_history_names_the_slowest() -> None:
    barrier = run(None, {"a": None, "b": None}).barrier
    assert barrier is not None
    a_loaded = ack(barrier, "Updated", loaded_version=1)
    half = run(barrier.model_copy(deep=True), {"a": a_loaded, "b": None}, seconds=1)
    assert half.barrier is not None and half.barrier.phase is BarrierPhase.UPDATE
    assert {c.phase for c in half.commands.values()} == {BarrierPhase.UPDATE}, "nobody resumes before all loaded"
    updated = run(half.barrier, {"a": a_loaded, "b": ack(barrier, "Updated", loaded_version=1)}, seconds=3)
    assert updated.barrier is not None and updated.barrier.phase is BarrierPhase.RESUME
    assert updated.committed is None, "weights count as committed only once every member resumed"
    done = run(updated.barrier, {n: ack(barrier, "Resumed", loaded_version=1) for n in "ab"}, seconds=5, loaded=1)
    assert done.barrier is None and done.committed == V1, "committed as announced, with its size"
    assert done.record is not None
    assert done.record.phase_seconds == {"Update": 3.0, "Resume": 2.0}
    assert done.record.slowest_pod == "b" and done.record.seconds == 5.0


def test_a_rolling_barrier_asks_each_member_once_and_commits_when_every_member_resumed() -> None:
    """spec.weightSync.mode Rolling: one command per member (Resume: stage, pause, swap, resume on its own); a
    member that resumed does not wait for the others, but the version counts as committed only once all did."""
    barrier = run(None, {"a": None, "b": None}, rolling=True).barrier
    assert barrier is not None and barrier.phase is BarrierPhase.RESUME
    a_resumed = ack(barrier, "Resumed", loaded_version=1)
    half = run(barrier.model_copy(deep=True), {"a": a_resumed, "b": None}, seconds=1, rolling=True)
    assert half.barrier is not None and half.committed is None, "b still serves version 0"
    assert {c.phase for c in half.commands.values()} == {BarrierPhase.RESUME}
    errored = run(
        half.barrier.model_copy(deep=True), {"a": a_resumed, "b": ack(barrier, "Resumed", error="digest")}, rolling=True
    )
    assert errored.barrier is not None and errored.commands["b"].retry == 1, "an error is asked again, as in Lockstep"
    done = run(half.barrier, {n: ack(barrier, "Resumed", loaded_version=1) for n in "ab"}, seconds=2, loaded=1)
    assert done.barrier is None and done.committed == V1
    assert done.record is not None and done.record.phase_seconds == {"Resume": 2.0}


def test_stale_and_unreadable_acks_are_ignored_and_reported_once() -> None:
    barrier = run(None, {"a": None}).barrier
    assert barrier is not None
    stale = json.dumps({"protocol": PROTOCOL, "id": "job/0/1", "phase": "Updated"})
    assert run(barrier.model_copy(deep=True), {"a": stale}).barrier.phase is BarrierPhase.UPDATE  # type: ignore[union-attr]
    old = json.dumps({"protocol": 1, "id": barrier.id, "phase": "Updated"})
    assert any("speaks barrier protocol 1; this version speaks 2" in n for n in run(barrier, {"a": old}).notes)
    first = run(barrier, {"a": "{oops"})
    assert any("ignored the ack on a: it is not a valid Ack document" in note for note in first.notes)
    again = run(first.barrier, {"a": "{oops"})
    assert not again.notes, "an invalid ack is reported once, not on every pass"


def test_timeout_fails_the_job_naming_the_straggler() -> None:
    barrier = run(None, {"a": None, "b": None}).barrier
    assert barrier is not None
    decision = run(barrier, {"a": ack(barrier, "Updated", loaded_version=1), "b": None}, seconds=31)
    assert decision.barrier is None and decision.record is not None and decision.record.outcome == "Failed"
    assert decision.failed == (
        "weight update to version 1 failed in phase Update: b did not ack Update in time "
        "(spec.weightSync.onTimeout: FailJob)"
    )


def test_evict_straggler_goes_on_without_it() -> None:
    barrier = run(None, {"a": None, "b": None}, on_timeout=TimeoutAction.EVICT_STRAGGLER).barrier
    assert barrier is not None
    a_loaded = ack(barrier, "Updated", loaded_version=1)
    decision = run(barrier, {"a": a_loaded, "b": None}, seconds=31, on_timeout=TimeoutAction.EVICT_STRAGGLER)
    assert decision.evict == ["b"] and decision.failed is None
    assert decision.barrier is not None and decision.barrier.phase is BarrierPhase.RESUME
    assert list(decision.commands) == ["a"]


def test_an_error_concerns_its_member_alone_which_is_asked_again() -> None:
    pods: dict[str, str | None] = {"a": None, "b": None, "c": None, "d": None}
    barrier = run(None, pods, on_timeout=TimeoutAction.EVICT_STRAGGLER).barrier
    assert barrier is not None
    acks = {**pods, "a": ack(barrier, "Updated", loaded_version=1), "b": ack(barrier, "Updated", error="transient")}
    decision = run(barrier.model_copy(deep=True), acks, seconds=5, on_timeout=TimeoutAction.EVICT_STRAGGLER)
    assert decision.failed is None and not decision.evict, "one error ack evicts nobody else"
    assert decision.barrier is not None and set(decision.barrier.members) == set(pods)
    assert {name: c.retry for name, c in decision.commands.items()} == {"a": 0, "b": 1, "c": 0, "d": 0}
    assert any("b reported an error: transient" in note and "retry 1 of 2" in note for note in decision.notes)
    again = run(decision.barrier.model_copy(deep=True), acks, seconds=6, on_timeout=TimeoutAction.EVICT_STRAGGLER)
    assert again.barrier is not None and again.barrier.retries == {"b": 1}, "the old error ack answers retry 0"
    failed_job = run(barrier, acks, seconds=5)
    assert failed_job.failed is None, "under FailJob too, an error is first asked again"


def test_a_member_whose_retries_are_spent_is_the_only_straggler() -> None:
    pods: dict[str, str | None] = {"a": None, "b": None, "c": None}
    for on_timeout in TimeoutAction:
        barrier = run(None, pods, on_timeout=on_timeout).barrier
        assert barrier is not None
        barrier.retries = {"b": MEMBER_RETRIES}
        b_failed = ack(barrier, "Updated", error="boom", retry=MEMBER_RETRIES)
        acks = {**pods, "a": ack(barrier, "Updated", loaded_version=1), "b": b_failed}
        decision = run(barrier, acks, on_timeout=on_timeout)
        if on_timeout is TimeoutAction.FAIL_JOB:
            assert decision.failed is not None and "b reported an error: boom (asked 3 times)" in decision.failed
            assert "c " not in decision.failed, "c has until the deadline"
        else:
            assert decision.evict == ["b"] and decision.barrier is not None
            assert set(decision.barrier.members) == {"a", "c"} and decision.barrier.phase is BarrierPhase.UPDATE


def test_a_barrier_left_without_members_is_not_completed() -> None:
    barrier = run(None, {"a": None, "b": None}, on_timeout=TimeoutAction.EVICT_STRAGGLER).barrier
    assert barrier is not None
    decision = run(barrier, {"a": None, "b": None}, seconds=31, on_timeout=TimeoutAction.EVICT_STRAGGLER)
    assert sorted(decision.evict) == ["a", "b"]
    assert decision.barrier is None and decision.committed is None, "no pod loaded version 1: nothing is committed"
    assert decision.record is not None and decision.record.outcome == "Failed"
    assert any("no member left" in note for note in decision.notes)
    gone = run(barrier.model_copy(deep=True), [], on_timeout=TimeoutAction.EVICT_STRAGGLER)
    assert gone.barrier is None and gone.committed is None and gone.record is not None


def test_a_replaced_member_leaves_and_a_lagging_pod_catches_up() -> None:
    barrier = run(None, {"a": None, "b": None}).barrier
    assert barrier is not None
    replaced = [Member("a", "uid-a", None, ack(barrier, "Paused")), Member("b", "uid-new", None, None)]
    decision = run(barrier, replaced)
    assert decision.barrier is not None and list(decision.barrier.members) == ["a"]
    catch_up = run(None, {"late": None}, committed=V2, announced=V2, loaded=1)
    assert catch_up.barrier is not None and catch_up.barrier.version == 2
    assert list(catch_up.barrier.members) == ["late"]


def test_a_collective_barrier_ranks_the_sender_first_and_the_receivers_by_name_in_the_update_phase() -> None:
    pods = {"trainer": None, "b": None, "a": None}
    assert run(None, {"a": None, "b": None}, sender="trainer").barrier is None, "no sender, no barrier"
    update = run(None, pods, sender="trainer")
    barrier = update.barrier
    assert barrier is not None and set(barrier.members) == {"trainer", "a", "b"} and barrier.sender == "trainer"
    groups = {name: command.group for name, command in update.commands.items()}
    assert {name: (g.rank_offset, g.world_size) for name, g in groups.items() if g} == {
        "trainer": (0, 5),
        "a": (1, 5),
        "b": (3, 5),
    }, "each actor holds ranks_per_member ranks (its vLLM workers)"
    resume = run(barrier, {n: ack(barrier, "Updated", loaded_version=1) for n in pods}, sender="trainer")
    assert all(c.group is None for c in resume.commands.values()), "the group exists only in the Update phase"


def test_a_broken_transfer_is_retried_in_a_new_group_then_its_receivers_are_stragglers() -> None:
    pods: dict[str, str | None] = {"trainer": None, "a": None, "b": None}
    update = run(None, pods, sender="trainer").barrier
    assert update is not None and update.transfer_ranks == {"trainer": 0, "a": 1, "b": 3}
    barrier = update
    a_has_it = Member("a", "uid-a", 1, ack(barrier, "Updated", loaded_version=1))
    retried = run(update.model_copy(deep=True), [a_has_it, Member("b", "uid-b", None, None)], sender="trainer")
    assert retried.failed is None and not retried.evict, "the trainer pod is gone: retry, do not give up"
    assert retried.record is not None and retried.record.outcome == "Failed"
    again = retried.barrier
    assert again is not None and again.id == "job/1/2" and again.phase is BarrierPhase.PAUSE
    assert set(again.members) == {"trainer", "a", "b"} and set(retried.commands) == {"a", "b"}
    assert any("retrying as barrier job/1/2 with a new transfer group" in note for note in retried.notes)

    new_trainer = Member("trainer", "uid-t2", None, ack(again, "Paused"))
    paused = [new_trainer, Member("a", "uid-a", 1, ack(again, "Paused"))]
    paused.append(Member("b", "uid-b", None, ack(again, "Paused")))
    regrouped = run(again, paused, sender="trainer").barrier
    assert regrouped is not None and regrouped.phase is BarrierPhase.UPDATE
    assert regrouped.transfer_ranks == {"trainer": 0, "b": 1}, "a already holds version 1: no rank for it"

    last = regrouped.model_copy(update={"id": "job/1/3", "attempt": 3}, deep=True)
    updated = Member("a", "uid-a", 1, ack(last, "Updated", loaded_version=1))
    waiting = [updated, Member("b", "uid-b", None, None)]  # the trainer is gone once more
    evicted = run(last.model_copy(deep=True), waiting, sender="trainer", on_timeout=TimeoutAction.EVICT_STRAGGLER)
    assert evicted.evict == ["b"], "a has its weights; b never will"
    failed = run(last, waiting, sender="trainer")
    assert failed.failed is not None
    assert (
        "b cannot receive weights version 1 after 3 attempts: trainer left the weight transfer group" in failed.failed
    )


def test_a_catch_up_barrier_joins_the_lagging_pod_and_the_sender() -> None:
    barrier = run(None, {"trainer": None, "a": None}, sender="trainer", committed=V1, announced=V1, loaded=1).barrier
    assert barrier is None, "nobody lags: no catch-up barrier"
    late = [
        Member("trainer", "uid-trainer", 1, None),
        Member("a", "uid-a", 1, None),
        Member("new", "uid-new", None, None),
    ]
    opened = run(None, late, committed=V1, announced=V1, sender="trainer").barrier
    assert opened is not None and set(opened.members) == {"trainer", "new"}, "a catch-up barrier for the new pod"


def test_a_sender_lost_mid_update_is_waited_for_in_a_paused_retry_and_its_replacement_sends() -> None:
    pods: dict[str, str | None] = {"trainer": None, "a": None}
    barrier = run(None, pods, sender="trainer").barrier
    assert barrier is not None and barrier.phase is BarrierPhase.UPDATE
    gone = run(barrier.model_copy(deep=True), {"a": None}, sender="trainer")
    retry = gone.barrier
    assert retry is not None and retry.id == "job/1/2" and retry.phase is BarrierPhase.PAUSE
    assert {name: c.phase for name, c in gone.commands.items()} == {"a": BarrierPhase.PAUSE}, "a stays paused"
    waiting = run(retry.model_copy(deep=True), {"a": ack(retry, "Paused")}, sender="trainer")
    assert waiting.failed is None and not waiting.evict and list(waiting.commands) == ["a"]
    assert waiting.barrier is not None and waiting.barrier.phase is BarrierPhase.PAUSE
    replaced = [
        Member("trainer", "uid-new", None, None),
        Member("a", "uid-a", None, ack(retry, "Paused")),
    ]
    adopted = run(waiting.barrier.model_copy(deep=True), replaced, sender="trainer")
    assert adopted.barrier is not None and adopted.barrier.members["trainer"] == "uid-new"
    assert adopted.commands["trainer"].phase is BarrierPhase.PAUSE, "the new sender is asked to pause first"
    assert any("the new pod sends the weights" in note for note in adopted.notes)
    late = run(waiting.barrier, {"a": ack(retry, "Paused")}, sender="trainer", seconds=31)
    assert late.failed is not None and "trainer did not ack Pause in time" in late.failed


def test_weights_announced_while_a_barrier_runs_open_the_next_one_in_the_step_that_closes_it() -> None:
    """Issue 21 item 8: the pass that closes a barrier may be the one the announcement asked for; no other comes."""
    barrier = run(None, {"a": None, "b": None}).barrier
    assert barrier is not None
    resuming = run(barrier, {n: ack(barrier, "Updated", loaded_version=1) for n in "ab"}, seconds=1).barrier
    assert resuming is not None and resuming.phase is BarrierPhase.RESUME
    resumed = {n: ack(barrier, "Resumed", loaded_version=1) for n in "ab"}
    done = run(resuming, resumed, seconds=2, loaded=1, announced=V2)
    assert done.committed == V1 and done.record is not None and done.record.outcome == "Completed"
    assert done.barrier is not None and done.barrier.id == "job/2/2" and done.barrier.phase is BarrierPhase.UPDATE
    assert set(done.barrier.members) == {"a", "b"} and done.acked == [], "the closed barrier's acks answer not this one"
    assert {name: c.id for name, c in done.commands.items()} == {"a": "job/2/2", "b": "job/2/2"}
    assert done.notes[-1] == "opened barrier job/2/2 for weights version 2 with 2 member(s)"
    failed = run(resuming, {"a": resumed["a"], "b": None}, seconds=31, loaded=1, announced=V2)
    assert failed.barrier is None and failed.failed is not None, "a failed barrier opens none (the job failed)"


def test_an_interrupted_barrier_is_recorded_with_its_reason_and_commits_nothing() -> None:
    opened = run(None, {"a": None, "b": None}).barrier
    assert opened is not None
    record = interrupt(opened, NOW + dt.timedelta(seconds=4), "Preempted")
    assert (record.outcome, record.reason, record.version) == (BarrierOutcome.INTERRUPTED, "Preempted", 1)
    assert record.seconds == 4 and record.members == 2, "its time ends when the pods were stopped"


def test_a_members_initial_weights_count_only_as_a_document_of_this_protocol() -> None:
    def loaded(initial: str, reads_initial_weights: bool = True) -> int | None:
        pod = {"metadata": {"name": "a", "uid": "uid-a", "annotations": {keys.INITIAL_WEIGHTS: initial}}}
        return member_of(pod, reads_initial_weights=reads_initial_weights).loaded_version

    assert loaded(document(V2)) == 2
    assert loaded(document(V2), reads_initial_weights=False) is None, "a collective backend loads none at start"
    other_protocol = json.dumps({**json.loads(document(V2)), "protocol": PROTOCOL - 1})
    assert loaded(other_protocol) is None, "another protocol's version is not this one's (protocol.read_document)"
    assert loaded("{not json") is None


@settings(max_examples=60, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=30))
def test_barrier_ids_are_unique_over_the_jobs_life_beyond_the_history_length(completes: list[bool]) -> None:
    """Issue 37 item 4: ids numbered 1 + the barriers of that version in the history (capped at HISTORY_LENGTH)
    repeated after 10 failed barriers for one version; a counter in the status numbers them instead. (Failures in a
    row stall a version now, ``held_back``: here they may go on, turns apart beyond any backoff.)"""
    history: list[BarrierRecord] = []
    opened, committed, barrier = 0, None, None
    ids: list[str] = []

    def at(now: dt.datetime, members: list[Member]) -> None:
        nonlocal opened, history, committed, barrier
        version = (committed.version if committed else 0) + 1
        decision = step(
            job_uid="job",
            barrier=barrier,
            committed=committed,
            announced=Weights(version=version, uri="file:///w", digest="sha256:x"),
            members=members,
            history=history,
            now=now,
            timeout_seconds=30,
            on_timeout=TimeoutAction.EVICT_STRAGGLER,
            opened=opened,
        )
        opened, committed, barrier = decision.opened, decision.committed, decision.barrier
        history = remember(history, decision.record)
        if barrier is not None and barrier.id not in ids[-1:]:
            ids.append(barrier.id)

    with mock.patch("lockstep.barrier.STALL_AFTER_FAILURES", HISTORY_LENGTH * 10):
        for turn, complete in enumerate([*completes, *[False] * (HISTORY_LENGTH + 2)]):
            now = NOW + dt.timedelta(seconds=1000 * turn)
            pods = [Member(name, f"uid-{name}-{turn}", committed.version if committed else None, None) for name in "ab"]
            at(now, pods)
            assert barrier is not None
            if complete:
                loaded = barrier.version
                updated = [dataclasses.replace(p, ack=ack(barrier, "Updated", loaded_version=loaded)) for p in pods]
                at(now + dt.timedelta(seconds=1), updated)
                assert barrier is not None
                resumed = [dataclasses.replace(p, ack=ack(barrier, "Resumed", loaded_version=loaded)) for p in pods]
                at(now + dt.timedelta(seconds=2), resumed)
            else:
                at(now + dt.timedelta(seconds=50), pods)  # past the deadline: both members evicted, the barrier fails
            barrier = None  # the next turn's pods are new
    assert len(ids) == len(set(ids)), f"a barrier id repeated: {ids}"
    assert opened == len(ids)


def failed(version: int, seconds: float, error: str = "a reported error: size mismatch") -> BarrierRecord:
    finished = rfc3339(NOW + dt.timedelta(seconds=seconds), milliseconds=True)
    return BarrierRecord(
        id=f"job/{version}/{seconds}",
        version=version,
        outcome=BarrierOutcome.FAILED,
        seconds=1.0,
        phase_seconds={},
        members=1,
        finished_at=finished,
        error=error,
    )


def test_a_version_that_keeps_failing_backs_off_then_stalls_and_a_newer_one_starts_afresh() -> None:
    """Issue 37, risk: a version no actor could load gave 11 barriers and 12 pod replacements in 70 s. Failed
    barriers in a row for one version wait 10 s, 20 s, 40 s, 80 s before the next; after 5, none opens."""
    assert STALL_AFTER_FAILURES == 5
    history: list[BarrierRecord] = []
    for k, wait in enumerate([10, 20, 40, 80], start=1):
        history.append(failed(7, 1000 * k))
        last = NOW + dt.timedelta(seconds=1000 * k)
        hold = held_back(history, 7, last + dt.timedelta(seconds=wait - 1))
        assert hold is not None and hold.failures == k and hold.until == last + dt.timedelta(seconds=wait)
        assert held_back(history, 7, last + dt.timedelta(seconds=wait)) is None, "the wait is over"
    history.append(failed(7, 5000, "actor-0 reported error: size of tensor a (128) must match (256)"))
    stalled = held_back(history, 7, NOW + dt.timedelta(days=1))
    assert stalled is not None and stalled.until is None and stalled.failures == 5
    assert stalled.words() == (
        "weights version 7 failed in 5 barrier(s) in a row (the last: actor-0 reported error: size of tensor a (128) "
        "must match (256))"
    )
    assert held_back(history, 8, NOW + dt.timedelta(days=1)) is None, "a newer version starts afresh"
    interrupted = failed(7, 5001).model_copy(update={"outcome": BarrierOutcome.INTERRUPTED})
    assert held_back([*history, interrupted], 7, NOW + dt.timedelta(days=1)) is not None, "an interruption is no fix"
    completed = failed(6, 5002).model_copy(update={"outcome": BarrierOutcome.COMPLETED})
    assert held_back([*history, completed], 7, NOW + dt.timedelta(days=1)) is None, "a completed barrier resets"
    assert held_back([*history, failed(8, 5003)], 7, NOW + dt.timedelta(days=1)) is None


def test_a_failed_barrier_records_when_and_why() -> None:
    barrier = run(None, {"a": None}).barrier
    assert barrier is not None
    error = ack(barrier, "Updated", error="cannot load: size mismatch")
    for retry in range(MEMBER_RETRIES + 1):
        decision = run(barrier.model_copy(deep=True), {"a": error}, on_timeout=TimeoutAction.EVICT_STRAGGLER)
        barrier = decision.barrier or barrier
        error = ack(barrier, "Updated", error="cannot load: size mismatch", retry=retry + 1)
    record = decision.record
    assert record is not None and record.outcome is BarrierOutcome.FAILED and record.finished_at is not None
    assert record.error is not None and "cannot load: size mismatch" in record.error
