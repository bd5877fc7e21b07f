"""The operator's work queue: one pass at a time per job, requests coalesced, one wake-up timer per job.

Our own, not kopf's: kopf runs a handler per event (a burst of pod events would cost a pass each, where this
queue runs one more pass for all of them), and its timers are periodic and put a finalizer on every object that
has one (an RLJob must never wait on the operator to go away); the kubernetes client has no work queue.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from lockstep.events import JobKey, PassScope


class WorkQueue:
    """Runs ``work(key, scope)``, a pass, on the thread that asks for one. A request for a job whose pass is running
    marks it dirty: one more pass follows, of the widest scope asked for meanwhile. A pass that raises ends the
    job's run, and the exception goes to the caller; what was asked for meanwhile runs after the next request's
    pass."""

    def __init__(self, work: Callable[[JobKey, PassScope], None]) -> None:
        self._work = work
        self._guard = threading.Lock()
        self._running: set[JobKey] = set()
        self._dirty: dict[JobKey, PassScope] = {}
        """Jobs asked for again while their pass ran: the scope of the pass that follows."""
        self._timers: dict[JobKey, tuple[float, threading.Timer]] = {}
        """Each job's wake-up: when it is due (time.monotonic()), and its timer."""

    def request(self, key: JobKey, scope: PassScope = PassScope.FULL) -> None:
        """Run the job's pass now, or once more right after the one already running for it."""
        with self._guard:
            if key in self._running:
                self._dirty[key] = scope.join(self._dirty.get(key))
                return
            self._running.add(key)
        try:
            while True:
                self._work(key, scope)
                with self._guard:
                    if key not in self._dirty:
                        # In the same hold of the guard as the check: a request that comes after it finds the job
                        # not running and runs its own pass (released later, it would only mark the job dirty).
                        self._running.discard(key)
                        return
                    scope = self._dirty.pop(key)
        except Exception:
            with self._guard:
                self._running.discard(key)
            raise

    def again(self, key: JobKey, scope: PassScope = PassScope.FULL) -> None:
        """One more pass right after the one running for the job (its pass asks: before it returns, the job is
        running, so this only marks it dirty)."""
        with self._guard:
            self._dirty[key] = scope.join(self._dirty.get(key))

    def wake_in(self, key: JobKey, seconds: float) -> None:
        """One timer per job: a pass of the whole pipeline ``seconds`` from now, unless one is due sooner (a pass
        of the barrier step alone knows only the barrier's deadline; one that wakes early finds nothing to do)."""
        now = time.monotonic()
        due = now + seconds
        with self._guard:
            kept_due, kept = self._timers.get(key, (0.0, None))
            if kept is not None and now < kept_due <= due:
                return
            timer = threading.Timer(seconds, self.request, (key,))
            timer.daemon = True
            self._timers[key] = (due, timer)
        if kept is not None:
            kept.cancel()
        timer.start()

    def forget(self, key: JobKey) -> None:
        """The job is gone: its wake-up is cancelled."""
        with self._guard:
            _, timer = self._timers.pop(key, (0.0, None))
        if timer is not None:
            timer.cancel()
