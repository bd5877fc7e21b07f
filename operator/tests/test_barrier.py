"""The barrier state machine, one situation at a time (the interleavings are in
workers/tests/test_barrier_simulation.py)."""

from __future__ import annotations

import datetime as dt
import json

from factories import NOW
from lockstep.api import Ack, BarrierPhase, BarrierStatus, TimeoutAction, Weights
from lockstep.barrier import Decision, Member, step

V1 = Weights(version=1, uri="file:///w/v1", digest="sha256:1")
V2 = Weights(version=2, uri="file:///w/v2", digest="sha256:2")


def ack(barrier: BarrierStatus, phase: str, **extra: object) -> str:
    return json.dumps(Ack(id=barrier.id, phase=phase, **extra).model_dump(mode="json", by_alias=True))  # type: ignore[arg-type]


def members(acks: dict[str, str | None], loaded: int | None = None) -> list[Member]:
    return [Member(name, f"uid-{name}", True, loaded, text) for name, text in acks.items()]


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
    )


def test_announced_weights_open_a_barrier_that_pauses_every_member() -> None:
    decision = run(None, {"a": None, "b": None})
    assert decision.barrier is not None and decision.barrier.id == "job/1/1"
    assert {name: c.phase for name, c in decision.commands.items()} == {
        "a": BarrierPhase.PAUSE,
        "b": BarrierPhase.PAUSE,
    }
    assert run(None, {"a": None}, committed=V1, loaded=1).barrier is None, "nothing newer than committed: no barrier"


def test_phases_advance_only_when_every_member_acked_and_history_names_the_slowest() -> None:
    barrier = run(None, {"a": None, "b": None}).barrier
    assert barrier is not None
    half = run(barrier.model_copy(deep=True), {"a": ack(barrier, "Paused"), "b": None}, seconds=1)
    assert half.barrier is not None and half.barrier.phase is BarrierPhase.PAUSE
    both = run(half.barrier, {"a": ack(barrier, "Paused"), "b": ack(barrier, "Paused")}, seconds=2)
    assert both.barrier is not None and both.barrier.phase is BarrierPhase.UPDATE
    updated = run(both.barrier, {n: ack(barrier, "Updated", loaded_version=1) for n in "ab"}, seconds=3)
    assert updated.barrier is not None and updated.barrier.phase is BarrierPhase.RESUME
    assert updated.committed is None, "weights count as committed only once every member resumed"
    done = run(updated.barrier, {n: ack(barrier, "Resumed", loaded_version=1) for n in "ab"}, seconds=5)
    assert done.barrier is None and done.committed == V1
    assert done.record is not None
    assert done.record.phase_seconds == {"Pause": 2.0, "Update": 1.0, "Resume": 2.0}
    assert done.record.slowest_pod == "b" and done.record.seconds == 5.0


def test_stale_and_unreadable_acks_are_ignored_and_reported_once() -> None:
    barrier = run(None, {"a": None}).barrier
    assert barrier is not None
    stale = json.dumps({"protocol": 1, "id": "job/0/1", "phase": "Paused"})
    assert run(barrier.model_copy(deep=True), {"a": stale}).barrier.phase is BarrierPhase.PAUSE  # type: ignore[union-attr]
    first = run(barrier, {"a": "{oops"})
    assert any("ignored the ack on a: it is not a valid Ack document" in note for note in first.notes)
    again = run(first.barrier, {"a": "{oops"})
    assert not again.notes, "an invalid ack is reported once, not on every pass"


def test_timeout_fails_the_job_naming_the_straggler() -> None:
    barrier = run(None, {"a": None, "b": None}).barrier
    assert barrier is not None
    decision = run(barrier, {"a": ack(barrier, "Paused"), "b": None}, seconds=31)
    assert decision.barrier is None and decision.record is not None and decision.record.outcome == "Failed"
    assert decision.failed == (
        "weight update to version 1 failed in phase Pause: b did not ack Pause in time "
        "(spec.weightSync.onTimeout: FailJob)"
    )


def test_evict_straggler_goes_on_without_it() -> None:
    barrier = run(None, {"a": None, "b": None}, on_timeout=TimeoutAction.EVICT_STRAGGLER).barrier
    assert barrier is not None
    decision = run(
        barrier, {"a": ack(barrier, "Paused"), "b": None}, seconds=31, on_timeout=TimeoutAction.EVICT_STRAGGLER
    )
    assert decision.evict == ["b"] and decision.failed is None
    assert decision.barrier is not None and decision.barrier.phase is BarrierPhase.UPDATE
    assert list(decision.commands) == ["a"]


def test_an_error_ack_is_a_straggler_at_once() -> None:
    barrier = run(None, {"a": None}).barrier
    assert barrier is not None
    paused = run(barrier, {"a": ack(barrier, "Paused")}).barrier
    assert paused is not None
    decision = run(paused, {"a": ack(paused, "Updated", error="OSError: digest mismatch")})
    assert decision.failed is not None and "a reported an error: OSError: digest mismatch" in decision.failed


def test_a_replaced_member_leaves_and_a_lagging_pod_catches_up() -> None:
    barrier = run(None, {"a": None, "b": None}).barrier
    assert barrier is not None
    replaced = [Member("a", "uid-a", True, None, ack(barrier, "Paused")), Member("b", "uid-new", True, None, None)]
    decision = run(barrier, replaced)
    assert decision.barrier is not None and list(decision.barrier.members) == ["a"]
    catch_up = run(None, {"late": None}, committed=V2, announced=V2, loaded=1)
    assert catch_up.barrier is not None and catch_up.barrier.version == 2
    assert list(catch_up.barrier.members) == ["late"]


def test_a_collective_barrier_ranks_the_sender_first_and_the_receivers_by_name_in_the_update_phase() -> None:
    pods = {"trainer": None, "b": None, "a": None}
    assert run(None, {"a": None, "b": None}, sender="trainer").barrier is None, "no sender, no barrier"
    barrier = run(None, pods, sender="trainer").barrier
    assert barrier is not None and set(barrier.members) == {"trainer", "a", "b"}
    assert all(c.group is None for c in run(barrier.model_copy(deep=True), pods, sender="trainer").commands.values())
    update = run(barrier, {n: ack(barrier, "Paused") for n in pods}, sender="trainer")
    groups = {name: command.group for name, command in update.commands.items()}
    assert {name: (g.rank_offset, g.world_size) for name, g in groups.items() if g} == {
        "trainer": (0, 5),
        "a": (1, 5),
        "b": (3, 5),
    }, "each actor holds ranks_per_member ranks (its vLLM workers)"
    assert update.barrier is not None
    resume = run(update.barrier, {n: ack(barrier, "Updated", loaded_version=1) for n in pods}, sender="trainer")
    assert all(c.group is None for c in resume.commands.values()), "the group exists only in the Update phase"


def test_a_broken_transfer_is_retried_in_a_new_group_then_its_receivers_are_stragglers() -> None:
    pods: dict[str, str | None] = {"trainer": None, "a": None, "b": None}
    barrier = run(None, pods, sender="trainer").barrier
    assert barrier is not None
    update = run(barrier, {n: ack(barrier, "Paused") for n in pods}, sender="trainer").barrier
    assert update is not None and update.transfer_ranks == {"trainer": 0, "a": 1, "b": 3}
    a_has_it = Member("a", "uid-a", True, 1, ack(barrier, "Updated", loaded_version=1))
    retried = run(update.model_copy(deep=True), [a_has_it, Member("b", "uid-b", True, None, None)], sender="trainer")
    assert retried.failed is None and not retried.evict, "the trainer pod is gone: retry, do not give up"
    assert retried.record is not None and retried.record.outcome == "Failed"
    again = retried.barrier
    assert again is not None and again.id == "job/1/2" and again.phase is BarrierPhase.PAUSE
    assert set(again.members) == {"trainer", "a", "b"} and set(retried.commands) == {"a", "b"}
    assert any("retrying as barrier job/1/2 with a new transfer group" in note for note in retried.notes)

    new_trainer = Member("trainer", "uid-t2", True, None, ack(again, "Paused"))
    paused = [new_trainer, Member("a", "uid-a", True, 1, ack(again, "Paused"))]
    paused.append(Member("b", "uid-b", True, None, ack(again, "Paused")))
    regrouped = run(again, paused, sender="trainer").barrier
    assert regrouped is not None and regrouped.phase is BarrierPhase.UPDATE
    assert regrouped.transfer_ranks == {"trainer": 0, "b": 1}, "a already holds version 1: no rank for it"

    last = regrouped.model_copy(update={"id": "job/1/3"}, deep=True)
    updated = Member("a", "uid-a", True, 1, ack(last, "Updated", loaded_version=1))
    waiting = [updated, Member("b", "uid-b", True, None, None)]  # the trainer is gone once more
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
        Member("trainer", "uid-trainer", True, 1, None),
        Member("a", "uid-a", True, 1, None),
        Member("new", "uid-new", True, None, None),
    ]
    opened = run(None, late, committed=V1, announced=V1, sender="trainer").barrier
    assert opened is not None and set(opened.members) == {"trainer", "new"}, "a catch-up barrier for the new pod"


def test_a_sender_replaced_before_it_sent_anything_is_waited_for_and_its_replacement_sends() -> None:
    pods: dict[str, str | None] = {"trainer": None, "a": None}
    barrier = run(None, pods, sender="trainer").barrier
    assert barrier is not None
    waiting = run(barrier.model_copy(deep=True), {"a": ack(barrier, "Paused")}, sender="trainer")
    assert waiting.failed is None and not waiting.evict and list(waiting.commands) == ["a"]
    assert waiting.barrier is not None and waiting.barrier.phase is BarrierPhase.PAUSE
    replaced = [
        Member("trainer", "uid-new", True, None, None),
        Member("a", "uid-a", True, None, ack(barrier, "Paused")),
    ]
    adopted = run(waiting.barrier, replaced, sender="trainer")
    assert adopted.barrier is not None and adopted.barrier.members["trainer"] == "uid-new"
    assert adopted.commands["trainer"].phase is BarrierPhase.PAUSE, "the new sender is asked to pause first"
    assert any("the new pod sends the weights" in note for note in adopted.notes)
    late = run(waiting.barrier, {"a": ack(barrier, "Paused")}, sender="trainer", seconds=31)
    assert late.failed is not None and "trainer did not ack Pause in time" in late.failed
