"""Where a real barrier's time goes: the operator, the agents, the API server, and the actors' own work.

A barrier's critical path runs through the slowest member of each phase: the operator writes its Update
command, the API server takes the write, its agent sees it and pauses, the actor pauses and loads, the agent
acks, the API server takes the ack; then the same for Resume, the phase's slowest member being the one whose
Resumed ack lands last; then the operator writes the status that closes the barrier. The API server's audit log
(requestReceivedTimestamp, stageTimestamp) times every write, and each actor records when it paused, loaded and
resumed (``lockstep.actor``'s "weight update done" lines), on the same clock when the pods run on this machine,
as the demo's do. The four shares add up to the time from the first command to the closing status write.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from lockstep import keys

SLACK_SECONDS = 0.005
"""An ack is written right after its work ends, and a pass can start a moment before the write's answer is sent:
timestamps this close are taken as in order."""


@dataclass(frozen=True, order=True)
class Write:
    start: float
    end: float
    pod: str | None
    """The pod patched; None for the RLJob's status."""
    by_operator: bool


@dataclass(frozen=True)
class BarrierTime:
    """One barrier's critical path, in seconds."""

    version: int
    operator: float
    """From the barrier's first command to the slowest member's, from a phase's last ack to the next phase's
    command, and from the last Resumed ack to the status write that closes the barrier."""
    agents: float
    """From a command written to its agent acting on it, and from the work done to the ack sent."""
    api_server: float
    """The four writes on the path: Update, Updated, Resume, Resumed."""
    own_work: float
    """The actors' own pause and load, then resume."""

    @property
    def beyond_own_work(self) -> float:
        return self.operator + self.agents + self.api_server


def writes(audit: list[dict[str, Any]], namespace: str, job: str) -> list[Write]:
    """The patches of ``job``'s actor pods and of its status, in the order the API server received them."""
    found = []
    for event in audit:
        ref = event.get("objectRef") or {}
        if (
            event.get("stage") != "ResponseComplete"
            or event.get("verb") != "patch"
            or ref.get("namespace") != namespace
        ):
            continue
        is_pod = ref.get("resource") == "pods" and str(ref.get("name", "")).startswith(f"{job}-{keys.ACTOR}-")
        is_status = ref.get("resource") == "rljobs" and ref.get("name") == job and ref.get("subresource") == "status"
        if is_pod or is_status:
            found.append(
                Write(
                    _seconds(event["requestReceivedTimestamp"]),
                    _seconds(event["stageTimestamp"]),
                    ref["name"] if is_pod else None,
                    event["user"]["username"] == keys.OPERATOR_USERNAME,
                )
            )
    return sorted(found)  # by start first


def barrier_times(
    audit: list[dict[str, Any]], namespace: str, job: str, updates: dict[str, list[dict[str, Any]]]
) -> list[BarrierTime]:
    """Each completed barrier of ``job`` that every actor recorded (``updates``: actor pod → its update records,
    with pausedAt, pauseSeconds, loadedAt, resumedAt and resumeSeconds), by version."""
    patches = writes(audit, namespace, job)
    by_version: dict[int, dict[str, dict[str, Any]]] = {}
    for pod, records in updates.items():
        for record in records:
            if "resumedAt" in record and record.get("pausedAt") is not None:
                by_version.setdefault(record["version"], {})[pod] = record
    times = []
    for version, recorded in sorted(by_version.items()):
        if set(recorded) == set(updates) and (time := _barrier_time(version, recorded, patches)) is not None:
            times.append(time)
    return times


def _barrier_time(version: int, records: dict[str, dict[str, Any]], patches: list[Write]) -> BarrierTime | None:
    """None when a write on the path is missing from the log (e.g. the log began mid-barrier)."""

    def command_before(pod: str, at: float) -> Write:
        return max(w for w in patches if w.pod == pod and w.by_operator and w.start < at)

    def ack_after(pod: str, at: float) -> Write:
        return min(w for w in patches if w.pod == pod and not w.by_operator and w.start >= at - SLACK_SECONDS)

    pause = {pod: r["pausedAt"] - r["pauseSeconds"] for pod, r in records.items()}
    resume = {pod: r["resumedAt"] - r["resumeSeconds"] for pod, r in records.items()}
    try:
        update_commands = {pod: command_before(pod, pause[pod]) for pod in records}
        updated = {pod: ack_after(pod, r["loadedAt"]) for pod, r in records.items()}
        resume_commands = {pod: command_before(pod, resume[pod]) for pod in records}
        resumed = {pod: ack_after(pod, r["resumedAt"]) for pod, r in records.items()}
        a = max(records, key=lambda pod: updated[pod].end)  # the Update phase's slowest member
        b = max(records, key=lambda pod: resumed[pod].end)  # the Resume phase's
        closing = min(w for w in patches if w.pod is None and w.start >= resumed[b].end - SLACK_SECONDS)
    except ValueError:  # min() or max() of nothing
        return None
    opened = min(w.start for w in update_commands.values())
    operator = (
        (update_commands[a].start - opened)
        + (resume_commands[b].start - updated[a].end)
        + (closing.start - resumed[b].end)
    )
    path = (update_commands[a], updated[a], resume_commands[b], resumed[b])
    agents = (
        (pause[a] - update_commands[a].end)
        + (updated[a].start - records[a]["loadedAt"])
        + (resume[b] - resume_commands[b].end)
        + (resumed[b].start - records[b]["resumedAt"])
    )
    own_work = (records[a]["loadedAt"] - pause[a]) + records[b]["resumeSeconds"]
    return BarrierTime(version, operator, agents, sum(w.end - w.start for w in path), own_work)


def _seconds(stamp: str) -> float:
    return dt.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def update_latencies(
    audit: list[dict[str, Any]], namespace: str, job: str, updates: dict[str, list[dict[str, Any]]]
) -> list[float]:
    """For each version every actor resumed on, the seconds from the trainer announcing it (its nth write on trainer
    rank 0's pod announces version n: ``lockstep_workers.trainer.pod.announce``, once a step) to the last actor
    resuming: what a serial loop waits for before it can sample with the new weights."""
    announced = sorted(
        _seconds(event["stageTimestamp"])
        for event in audit
        if event.get("stage") == "ResponseComplete"
        and event.get("verb") == "patch"
        and (ref := event.get("objectRef") or {}).get("namespace") == namespace
        and ref.get("resource") == "pods"
        and not ref.get("subresource")
        and ref.get("name") == f"{job}-{keys.TRAINER}-0"
        and event["user"]["username"] != keys.OPERATOR_USERNAME
    )
    resumed: dict[int, list[float]] = {}
    for records in updates.values():
        for record in records:
            if record.get("resumedAt") is not None:
                resumed.setdefault(record["version"], []).append(record["resumedAt"])
    return [
        max(times) - announced[version - 1]
        for version, times in sorted(resumed.items())
        if len(times) == len(updates) and 0 < version <= len(announced)
    ]
