"""lockstep.workqueue.WorkQueue on one thread: requests made inside a pass (as other threads would make them
meanwhile) and at every release of its lock."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from fake_clients import HookedLock
from lockstep.events import JobKey, PassScope
from lockstep.workqueue import WorkQueue

KEY: JobKey = ("team-a", "demo")
OTHER: JobKey = ("team-b", "demo")


class Passes:
    """The queue's work: records each pass, and runs ``during[n]`` inside the n-th pass (from 0)."""

    def __init__(self) -> None:
        self.runs: list[tuple[JobKey, PassScope]] = []
        self.during: dict[int, Callable[[], None]] = {}

    def __call__(self, key: JobKey, scope: PassScope) -> None:
        self.runs.append((key, scope))
        if (action := self.during.get(len(self.runs) - 1)) is not None:
            action()


def test_requests_during_a_pass_are_one_more_pass_of_the_widest_scope() -> None:
    passes = Passes()
    queue = WorkQueue(passes)
    passes.during[0] = lambda: [queue.request(KEY, PassScope.BARRIER), queue.request(KEY, PassScope.FULL)]
    queue.request(KEY, PassScope.BARRIER)
    assert passes.runs == [(KEY, PassScope.BARRIER), (KEY, PassScope.FULL)]
    assert queue._running == set() and queue._dirty == {}


def test_barrier_requests_alone_coalesce_into_a_barrier_pass() -> None:
    passes = Passes()
    queue = WorkQueue(passes)
    passes.during[0] = lambda: [queue.request(KEY, PassScope.BARRIER), queue.request(KEY, PassScope.BARRIER)]
    queue.request(KEY)
    assert passes.runs == [(KEY, PassScope.FULL), (KEY, PassScope.BARRIER)]


def test_another_job_runs_its_own_pass_meanwhile() -> None:
    passes = Passes()
    queue = WorkQueue(passes)
    passes.during[0] = lambda: queue.request(OTHER)
    queue.request(KEY)
    assert passes.runs == [(KEY, PassScope.FULL), (OTHER, PassScope.FULL)]


def test_a_pass_asks_again_for_its_own_job() -> None:
    passes = Passes()
    queue = WorkQueue(passes)
    passes.during[0] = lambda: queue.again(KEY, PassScope.BARRIER)
    queue.request(KEY)
    assert passes.runs == [(KEY, PassScope.FULL), (KEY, PassScope.BARRIER)]


def test_a_pass_that_raises_leaves_the_job_free_for_the_next_request() -> None:
    passes = Passes()
    queue = WorkQueue(passes)

    def fail() -> None:
        queue.request(KEY, PassScope.BARRIER)
        raise RuntimeError("a fault")

    passes.during[0] = fail
    with pytest.raises(RuntimeError):
        queue.request(KEY)
    assert queue._running == set()
    queue.request(KEY)
    assert passes.runs[1:] == [(KEY, PassScope.FULL), (KEY, PassScope.BARRIER)], "what was asked for meanwhile too"


def _releases_of_two_passes() -> int:
    released = [0]
    queue = WorkQueue(Passes())
    queue._guard = HookedLock(lambda: released.__setitem__(0, released[0] + 1))  # type: ignore[assignment]
    queue.request(KEY)
    queue.request(KEY)
    return released[0]


@pytest.mark.parametrize("point", range(1, _releases_of_two_passes() + 1))
def test_a_request_at_any_release_of_the_lock_gets_a_pass_that_starts_after_it(point: int) -> None:
    """The lost wake-up: a request made after a pass's last check for more must find the job not running."""
    passes = Passes()
    queue = WorkQueue(passes)
    released = [0]
    requested_after: list[int] = []

    def hook() -> None:
        released[0] += 1
        if released[0] == point:
            requested_after.append(len(passes.runs))
            queue.request(KEY, PassScope.BARRIER)

    queue._guard = HookedLock(hook)  # type: ignore[assignment]
    queue.request(KEY)
    queue.request(KEY)
    assert requested_after, "the request was made"
    assert len(passes.runs) > requested_after[0], f"no pass started after the request at release {point}"
    assert queue._running == set() and queue._dirty == {}


def test_one_timer_per_job_the_soonest_kept() -> None:
    passes = Passes()
    queue = WorkQueue(passes)
    queue.wake_in(KEY, 3000)
    first = queue._timers[KEY][1]
    queue.wake_in(KEY, 6000)
    assert queue._timers[KEY][1] is first, "a later wake-up leaves the sooner one"
    queue.wake_in(KEY, 1000)
    second = queue._timers[KEY][1]
    assert second is not first and first.finished.is_set(), "a sooner wake-up replaces (and cancels) the later one"
    second.function(*second.args)  # what the timer does when it fires
    assert passes.runs == [(KEY, PassScope.FULL)]
    queue.forget(KEY)
    assert second.finished.is_set() and KEY not in queue._timers
