"""The weight-update barrier (docs/barrier-protocol.md): its state machine (the documents are lockstep.protocol).

``step`` is pure: given the barrier recorded in the RLJob's status, the newest announced weights,
the member pods and their acks, it returns the barrier's next state and the command every member
pod should carry. The operator calls it on every pass; a restarted operator simply calls it again.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

from lockstep import keys
from lockstep.api import BarrierOutcome, BarrierRecord, BarrierStatus, TimeoutAction
from lockstep.origin import WeightsOrigin, origin_problem
from lockstep.protocol import ACK_FOR, Ack, BarrierPhase, Command, Weights, parse_ack, read_document
from lockstep.times import parse_rfc3339, rfc3339

HISTORY_LENGTH = 10
TRANSFER_ATTEMPTS = 3
"""Collective backends: attempts at one barrier's transfer, each in a new group, before the members still
waiting for the weights are stragglers."""
MEMBER_RETRIES = 2
"""How often a barrier asks a member again after it reported an error (the error may be transient) before the
member is a straggler."""
NEXT_PHASE = {BarrierPhase.PAUSE: BarrierPhase.UPDATE, BarrierPhase.UPDATE: BarrierPhase.RESUME}
STALL_AFTER_FAILURES = 5
"""Failed barriers in a row for one version after which none opens for it again (``held_back``): the members
keep serving the committed version until the trainer announces a newer one. A collective transfer's attempts each
count, so this is more than TRANSFER_ATTEMPTS."""
BACKOFF_SECONDS = 10.0
BACKOFF_LIMIT_SECONDS = 300.0
"""After k failed barriers in a row for one version, the next opens BACKOFF_SECONDS * 2^(k-1) seconds after the
last one closed, at most BACKOFF_LIMIT_SECONDS."""


@dataclass(frozen=True)
class Hold:
    """Why no barrier may open now for a version that failed in a row (``held_back``)."""

    version: int
    failures: int
    error: str | None
    until: dt.datetime | None
    """When a barrier may open again; None: stalled, none opens for this version."""

    def words(self) -> str:
        last = f" (the last: {self.error})" if self.error else ""
        return f"weights version {self.version} failed in {self.failures} barrier(s) in a row{last}"


def held_back(history: list[BarrierRecord], version: int, now: dt.datetime) -> Hold | None:
    """Whether a new barrier for ``version`` must wait, from the barrier history alone: after k failed barriers in
    a row for it (since the last completed barrier of any version; interrupted ones do not count), the next opens
    BACKOFF_SECONDS * 2^(k-1) s (at most BACKOFF_LIMIT_SECONDS) after the last closed, and after
    STALL_AFTER_FAILURES none does (``until`` None). None: a barrier may open now."""
    failed: list[BarrierRecord] = []
    for record in reversed(history):
        if record.outcome is BarrierOutcome.COMPLETED or (
            record.outcome is BarrierOutcome.FAILED and record.version != version
        ):
            break
        if record.outcome is BarrierOutcome.FAILED:
            failed.append(record)
    if not failed:
        return None
    last = failed[0]
    if len(failed) >= STALL_AFTER_FAILURES:
        return Hold(version, len(failed), last.error, None)
    if last.finished_at is None:
        return None  # recorded before the time was kept: nothing to wait from
    wait = min(BACKOFF_SECONDS * 2 ** (len(failed) - 1), BACKOFF_LIMIT_SECONDS)
    until = parse_rfc3339(last.finished_at) + dt.timedelta(seconds=wait)
    return Hold(version, len(failed), last.error, until) if now < until else None


@dataclass(frozen=True)
class Member:
    """A member pod as the operator sees it now."""

    name: str
    uid: str
    loaded_version: int | None
    ack: str | None
    """The raw ``lockstep.dev/barrier-ack`` annotation, if any."""


@dataclass
class Decision:
    barrier: BarrierStatus | None
    committed: Weights | None
    commands: dict[str, Command] = field(default_factory=dict)
    evict: list[str] = field(default_factory=list)
    acked: list[str] = field(default_factory=list)
    """The members that acked the open barrier's current phase, in the order ``step`` was given them (the shell
    orders them by when each ack arrived, so the last is the slowest). Derived from the pods on every call, never
    stored: a restarted operator finds the acks where they are."""
    failed: str | None = None
    record: BarrierRecord | None = None
    opened: int = 0
    """Barriers opened over the job's life, this step's included (``RLJob.status.barriersOpened``)."""
    held: Hold | None = None
    """Why no barrier opened for the version it would have loaded (``held_back``)."""
    error: str | None = None
    """Why the members of the open barrier fail, in words, for its record if it fails."""
    notes: list[str] = field(default_factory=list)
    """What happened, in words for Events."""


def _annotations(pod: dict[str, Any]) -> dict[str, str]:
    return pod["metadata"].get("annotations") or {}


def announced_by(trainer: dict[str, Any]) -> Weights | str | None:
    """The weights the trainer announced on its pod, why they are unreadable, or None."""
    return read_document(_annotations(trainer).get(keys.WEIGHTS), Weights)


def announcement_problem(weights: Weights, *, origin: WeightsOrigin, committed: Weights | None) -> str | None:
    """Why the operator refuses the trainer's announcement, or None. The weights must come from the job's own
    trainer (``origin``, lockstep.origin: a file in the job's weights directory with the filesystem backend, or
    trainer rank 0's manifest of that version with a collective one); and a version is never older than the
    committed one (a restarted trainer resumes from the newest version it published)."""
    if (problem := origin_problem(weights.uri, weights.version, origin)) is not None:
        return (
            f"announces weights version {weights.version} at {weights.uri}, which {problem}: the job takes weights "
            f"only from {origin.allowed(weights.version)}"
        )
    if committed is not None and weights.version < committed.version:
        return (
            f"announces weights version {weights.version}, older than the committed version {committed.version} "
            "(a version number names one set of weights and only grows)"
        )
    return None


def ack_on(pod: dict[str, Any]) -> Ack | str | None:
    """The ack on ``pod`` (``lockstep.dev/barrier-ack``), why it is unusable, or None when there is none."""
    return parse_ack(_annotations(pod).get(keys.BARRIER_ACK))


def member_of(pod: dict[str, Any], *, reads_initial_weights: bool = True) -> Member:
    """How the barrier sees a running pod: its ack, and the newest version it loaded (its ack, or the initial
    weights it loads at start when ``reads_initial_weights``: from files, not with a collective backend)."""
    annotations = _annotations(pod)
    ack = ack_on(pod)
    loaded = ack.loaded_version if isinstance(ack, Ack) else None
    if loaded is None and reads_initial_weights:
        initial = read_document(annotations.get(keys.INITIAL_WEIGHTS), Weights)
        loaded = initial.version if isinstance(initial, Weights) else None
    return Member(pod["metadata"]["name"], pod["metadata"]["uid"], loaded, annotations.get(keys.BARRIER_ACK))


def step(
    *,
    job_uid: str,
    barrier: BarrierStatus | None,
    committed: Weights | None,
    announced: Weights | None,
    members: list[Member],
    history: list[BarrierRecord],
    now: dt.datetime,
    timeout_seconds: float,
    on_timeout: TimeoutAction,
    sender: str | None = None,
    ranks_per_member: int = 1,
    rolling: bool = False,
    opened: int = 0,
) -> Decision:
    """Advance the barrier by what the member pods say; open one when weights are newer than committed (also
    right after the open one completed: the next barrier opens in the step that closes the last).

    Protocol 2: a barrier opens in ``Update`` (each member stages, pauses, then swaps) and moves to ``Resume`` once
    every member has loaded, so no member resumes a version before all of them hold it. ``sender`` names the
    member that sends the weights (the trainer, with a collective backend; None when the actors read files):
    rank 0 of the transfer group formed when the barrier opens, in which the members that need the weights
    get ``ranks_per_member`` ranks each (their vLLM workers). A transfer that breaks (a member of its group
    left or reported an error) is retried as a new attempt that opens in ``Pause``: the members stay paused
    while it waits for the sender (or its replacement), and its ``Update`` forms a new group. A ``rolling``
    barrier (no sender) opens in ``Resume``: each member stages, pauses, swaps and resumes on its own, and the
    barrier completes once every member acked ``Resumed``.

    ``opened`` counts the barriers opened over the job's life; each new one (a retry too) takes the next number as
    the last part of its id, so an ack for an earlier barrier never answers a later one.
    """
    decision = Decision(barrier=barrier, committed=committed, opened=opened_so_far(opened, barrier, history))
    seen = {m.name: m for m in members}
    if decision.barrier is not None:
        _advance(decision, seen, now, timeout_seconds, on_timeout, ranks_per_member)
        record = decision.record
        if decision.barrier is not None or record is None or record.outcome is not BarrierOutcome.COMPLETED:
            return _with_commands(decision, seen)
        # Completed: weights announced meanwhile (or members still behind) open the next barrier in this same
        # step. No later pass may come to open it: the request of the announcement may be the one this pass serves.
        history = remember(history, record)
        seen = {name: m for name, m in seen.items() if name not in decision.evict}
    new = _maybe_open(
        f"{job_uid}/", decision, announced, seen, history, now, timeout_seconds, sender, ranks_per_member, rolling
    )
    if new is None:
        return decision
    decision.barrier = new
    decision.notes.append(
        f"opened barrier {new.id} for weights version {new.version} with {len(new.members)} member(s)"
    )
    if decision.record is None:
        _advance(decision, seen, now, timeout_seconds, on_timeout, ranks_per_member)
    else:
        decision.acked = []  # the acks were the closed barrier's; none answers one whose commands are not written
    return _with_commands(decision, seen)


def _with_commands(decision: Decision, seen: dict[str, Member]) -> Decision:
    """The decision, with the open barrier's command for every member that runs."""
    if decision.barrier is not None:
        decision.commands = {name: decision.barrier.command(name) for name in decision.barrier.members if name in seen}
    return decision


def opened_so_far(opened: int, barrier: BarrierStatus | None, history: list[BarrierRecord]) -> int:
    """Barriers opened over the job's life: ``opened`` (status.barriersOpened), or more when the open barrier or
    the history has a larger number (a status written before the count existed)."""
    ids = [record.id for record in history] + ([barrier.id] if barrier else [])
    return max([opened, *(_number(barrier_id) for barrier_id in ids)])


def _number(barrier_id: str) -> int:
    last = barrier_id.rsplit("/", 1)[-1]
    return int(last) if last.isdigit() else 0


def _maybe_open(
    prefix: str,
    decision: Decision,
    announced: Weights | None,
    seen: dict[str, Member],
    history: list[BarrierRecord],
    now: dt.datetime,
    timeout_seconds: float,
    sender: str | None,
    ranks_per_member: int,
    rolling: bool,
) -> BarrierStatus | None:
    assert not (rolling and sender), "a rolling update has no transfer group"
    committed = decision.committed
    if sender is not None and sender not in seen:
        return None  # the weights can only come from the sender: wait for it
    receivers = [m for name, m in seen.items() if name != sender]
    if announced is not None and (committed is None or announced.version > committed.version):
        target, joining = announced, receivers
    elif committed is not None:
        # Catch-up: pods that started before the last update reached them.
        target = committed
        joining = [m for m in receivers if m.loaded_version is None or m.loaded_version < committed.version]
    else:
        return None
    if not joining:
        return None
    decision.held = held_back(history, target.version, now)
    if decision.held is not None:
        return None
    decision.opened += 1
    stamp = rfc3339(now, milliseconds=True)
    sending = [seen[sender]] if sender is not None else []
    barrier = BarrierStatus(
        id=f"{prefix}{target.version}/{decision.opened}",
        version=target.version,
        uri=target.uri,
        digest=target.digest,
        bytes=target.bytes,
        phase=BarrierPhase.RESUME if rolling else BarrierPhase.UPDATE,
        members={m.name: m.uid for m in [*sending, *joining]},
        sender=sender,
        started_at=stamp,
        phase_started_at=stamp,
        deadline=rfc3339(now + dt.timedelta(seconds=timeout_seconds), milliseconds=True),
    )
    if sender is not None:
        _form_transfer_group(barrier, seen, ranks_per_member)
    return barrier


def _advance(
    decision: Decision,
    seen: dict[str, Member],
    now: dt.datetime,
    timeout_seconds: float,
    on_timeout: TimeoutAction,
    ranks_per_member: int,
) -> None:
    barrier = decision.barrier
    assert barrier is not None
    for name, uid in list(barrier.members.items()):
        member = seen.get(name)
        if member is not None and member.uid == uid:
            continue
        if barrier.phase is BarrierPhase.PAUSE and name == barrier.sender:
            # A retry waits for the sender (or its replacement) before its Update forms the new group.
            if member is not None:
                barrier.members[name] = member.uid
                decision.notes.append(f"{name} was replaced; the new pod sends the weights of barrier {barrier.id}")
            continue
        del barrier.members[name]
        decision.notes.append(f"{name} left barrier {barrier.id} (deleted, failed or replaced)")
    while True:
        errors = _collect_acks(decision, seen)
        cut_off: dict[str, str] = {}
        if (failure := _transfer_failure(barrier, errors)) is not None:
            if barrier.attempt < TRANSFER_ATTEMPTS:
                _retry(decision, now, timeout_seconds, failure)
                return
            cut_off = _waiting_for_weights(barrier, decision.acked, failure)
        stragglers = {**_ask_again(decision, {k: v for k, v in errors.items() if k not in cut_off}), **cut_off}
        pending = [name for name in barrier.members if name not in decision.acked]
        if now >= parse_rfc3339(barrier.deadline):
            late = {name: f"did not ack {barrier.phase.value} in time" for name in pending}
            stragglers = {**late, **stragglers}
        if stragglers:
            if not _handle_stragglers(decision, stragglers, now, on_timeout):
                return
            continue
        if all(name == barrier.sender for name in barrier.members):
            _abandon(decision, now)
            return
        if pending:
            return
        if not _next_phase(decision, seen, now, timeout_seconds, ranks_per_member):
            return


def _ask_again(decision: Decision, errors: dict[str, str]) -> dict[str, str]:
    """An error concerns its member alone: ask it again (a new ``retry`` of the same command), up to
    MEMBER_RETRIES times in a barrier; return the members whose retries are spent, with their errors."""
    barrier = decision.barrier
    assert barrier is not None
    spent = {}
    for name, error in sorted(errors.items()):
        tries = barrier.retries.get(name, 0)
        if tries >= MEMBER_RETRIES:
            spent[name] = f"{error} (asked {tries + 1} times)"
            continue
        barrier.retries[name] = tries + 1
        decision.notes.append(
            f"{name} {error} in phase {barrier.phase.value} of barrier {barrier.id}; asking it again "
            f"(retry {tries + 1} of {MEMBER_RETRIES})"
        )
    return spent


def _abandon(decision: Decision, now: dt.datetime) -> None:
    """No member is left to take the weights (all evicted or gone): record the barrier as failed without
    committing its version. The replacements start from the committed weights and a new barrier brings them on."""
    barrier = decision.barrier
    assert barrier is not None
    decision.record = _record(barrier, BarrierOutcome.FAILED, now, decision.error or "every member left it")
    decision.notes.append(
        f"barrier {barrier.id} has no member left to load weights version {barrier.version}; it is closed "
        f"without committing that version, and a new barrier opens once the replacements run"
    )
    decision.barrier = None


def _transfer_failure(barrier: BarrierStatus, errors: dict[str, str]) -> str | None:
    """Collective backends, in the Update phase: why this attempt's transfer cannot complete (a member of its
    group left it or reported an error), or None."""
    if barrier.phase is not BarrierPhase.UPDATE or not barrier.transfer_ranks:
        return None
    lost = sorted(name for name in barrier.transfer_ranks if name not in barrier.members)
    failed = sorted(name for name in barrier.transfer_ranks if name in errors)
    reasons = [f"{', '.join(lost)} left the weight transfer group"] if lost else []
    reasons += [f"{name} {errors[name]}" for name in failed]
    return "; ".join(reasons) or None


def _retry(decision: Decision, now: dt.datetime, timeout_seconds: float, failure: str) -> None:
    """Record this attempt as failed and open the next one with the same members, still paused; its Update
    phase forms a new group. A sender that left is waited for, and its replacement sends."""
    old = decision.barrier
    assert old is not None
    sender = old.sender
    assert sender is not None
    decision.record = _record(old, BarrierOutcome.FAILED, now, failure)
    decision.opened += 1
    stamp = rfc3339(now, milliseconds=True)
    decision.barrier = BarrierStatus(
        id=f"{old.id.rsplit('/', 1)[0]}/{decision.opened}",
        version=old.version,
        attempt=old.attempt + 1,
        uri=old.uri,
        digest=old.digest,
        bytes=old.bytes,
        phase=BarrierPhase.PAUSE,
        members={**old.members, sender: old.members.get(sender, "")},
        sender=sender,
        started_at=stamp,
        phase_started_at=stamp,
        deadline=rfc3339(now + dt.timedelta(seconds=timeout_seconds), milliseconds=True),
        evicted=old.evicted,
    )
    decision.notes.append(
        f"the transfer of weights version {old.version} failed in barrier {old.id} ({failure}); retrying as "
        f"barrier {decision.barrier.id} with a new transfer group"
    )


def _waiting_for_weights(barrier: BarrierStatus, acked: list[str], failure: str) -> dict[str, str]:
    """The members that can no longer receive the weights, once the transfer attempts are spent."""
    barrier.transfer_ranks, barrier.transfer_world_size = {}, None
    why = f"cannot receive weights version {barrier.version} after {TRANSFER_ATTEMPTS} attempts: {failure}"
    return {name: why for name in barrier.members if name not in acked or barrier.phase is BarrierPhase.PAUSE}


def _collect_acks(decision: Decision, seen: dict[str, Member]) -> dict[str, str]:
    """Record in ``decision.acked`` the members whose ack answers the current phase, in the order of ``seen``;
    return the members whose ack reports an error."""
    barrier = decision.barrier
    assert barrier is not None
    errors: dict[str, str] = {}
    for name, member in seen.items():
        if name not in barrier.members:
            continue
        ack = parse_ack(member.ack)
        if isinstance(ack, str):
            if barrier.reported.get(name) != ack:
                barrier.reported[name] = ack
                decision.notes.append(f"ignored the ack on {name}: it {ack}")
            continue
        if ack is None or ack.id != barrier.id or ack.retry != barrier.retries.get(name, 0):
            continue  # none yet, or stale: from an earlier barrier, or answering an earlier try
        if ack.error:
            errors[name] = f"reported an error: {ack.error}"
        elif ack.phase == ACK_FOR[barrier.phase] and name not in decision.acked:
            decision.acked.append(name)
    return errors


def _handle_stragglers(
    decision: Decision, stragglers: dict[str, str], now: dt.datetime, on_timeout: TimeoutAction
) -> bool:
    """Fail the barrier, or evict the stragglers; True when the barrier goes on."""
    barrier = decision.barrier
    assert barrier is not None
    what = "; ".join(f"{name} {why}" for name, why in sorted(stragglers.items()))
    decision.error = what
    if on_timeout is TimeoutAction.FAIL_JOB:
        decision.failed = (
            f"weight update to version {barrier.version} failed in phase {barrier.phase.value}: {what} "
            "(spec.weightSync.onTimeout: FailJob)"
        )
        decision.record = _record(barrier, BarrierOutcome.FAILED, now, what)
        decision.barrier = None
        return False
    for name in stragglers:
        barrier.members.pop(name, None)
        barrier.evicted.append(name)
        decision.evict.append(name)
    decision.notes.append(f"evicted from barrier {barrier.id}: {what}; they rejoin on the newest weights")
    return True


def _next_phase(
    decision: Decision, seen: dict[str, Member], now: dt.datetime, timeout_seconds: float, ranks_per_member: int
) -> bool:
    """Every member acked the current phase: move on, or close the barrier. True when it is still open."""
    barrier = decision.barrier
    assert barrier is not None
    barrier.phase_seconds[barrier.phase.value] = round(
        (now - parse_rfc3339(barrier.phase_started_at)).total_seconds(), 3
    )
    if decision.acked:
        barrier.slowest[barrier.phase.value] = decision.acked[-1]
    following = NEXT_PHASE.get(barrier.phase)
    if following is None:
        decision.committed = barrier.weights()
        decision.record = _record(barrier, BarrierOutcome.COMPLETED, now)
        decision.notes.append(
            f"weights version {barrier.version} live on {len(barrier.members)} member(s) after "
            f"{decision.record.seconds:.2f} s"
        )
        decision.barrier = None
        return False
    barrier.phase = following
    if following is BarrierPhase.UPDATE and barrier.sender is not None:
        _form_transfer_group(barrier, seen, ranks_per_member)
    barrier.phase_started_at = rfc3339(now, milliseconds=True)
    barrier.deadline = rfc3339(now + dt.timedelta(seconds=timeout_seconds), milliseconds=True)
    decision.acked = []
    return True


def _form_transfer_group(barrier: BarrierStatus, seen: dict[str, Member], ranks_per_member: int) -> None:
    """Rank the members that need the weights after the sender (rank 0), in name order; with none, no group."""
    sender = barrier.sender
    assert sender is not None
    receivers = sorted(
        name for name in barrier.members if name != sender and seen[name].loaded_version != barrier.version
    )
    barrier.transfer_ranks = {sender: 0} if receivers else {}
    for position, name in enumerate(receivers):
        barrier.transfer_ranks[name] = 1 + position * ranks_per_member
    barrier.transfer_world_size = 1 + len(receivers) * ranks_per_member if receivers else None


def _record(
    barrier: BarrierStatus, outcome: BarrierOutcome, now: dt.datetime, error: str | None = None
) -> BarrierRecord:
    slowest = max(barrier.slowest.items(), key=lambda item: barrier.phase_seconds.get(item[0], 0), default=None)
    return BarrierRecord(
        id=barrier.id,
        version=barrier.version,
        outcome=outcome,
        seconds=_seconds_since(barrier.started_at, now),
        phase_seconds=barrier.phase_seconds,
        slowest_pod=slowest[1] if slowest else None,
        members=len(barrier.members),
        bytes=barrier.bytes,
        evicted=barrier.evicted,
        finished_at=rfc3339(now, milliseconds=True),
        error=error,
    )


def _seconds_since(stamp: str, now: dt.datetime) -> float:
    return round((now - parse_rfc3339(stamp)).total_seconds(), 3)


def interrupt(barrier: BarrierStatus, now: dt.datetime, reason: str) -> BarrierRecord:
    """The record of ``barrier`` closed because the job's pods are stopped (``reason``: queued, preempted,
    suspended): its version is not committed, and the pods start again from the committed weights."""
    return _record(barrier, BarrierOutcome.INTERRUPTED, now).model_copy(update={"reason": reason})


def remember(history: list[BarrierRecord], record: BarrierRecord | None) -> list[BarrierRecord]:
    """The history with ``record`` appended, keeping the newest HISTORY_LENGTH entries."""
    return history if record is None else [*history, record][-HISTORY_LENGTH:]


def closed_since(old: list[BarrierRecord], new: list[BarrierRecord]) -> list[BarrierRecord]:
    """The barriers in history ``new`` that history ``old`` did not hold: those a pass closed."""
    known = {record.id for record in old}
    return [record for record in new if record.id not in known]
