"""The barrier agent's core (docs/barrier-protocol.md): ``AgentCore`` decides what to do with a command and remembers
what it did, so a re-delivered command is acked again but never paused for or loaded twice. Its shell, which reads and
writes the pod, is lockstep_workers.agent.pod_agent."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

from lockstep.protocol import (
    ACK_FOR,
    Ack,
    BarrierPhase,
    Command,
    MemberStep,
    StepTimes,
    TransferGroup,
    Weights,
)

logger = logging.getLogger("lockstep.agent")


class Staged(Protocol):
    """Weights an engine made ready to swap in, while it kept generating."""

    def close(self) -> None:
        """Release what staging holds (the in-memory copy), swapped in or not."""


class Engine(Protocol):
    """What the agent drives: the vLLM actor implements it, and the trainer as the sender of the collective
    backends (its pause and resume do nothing)."""

    def pause(self) -> None:
        """Stop scheduling; keep in-flight requests and the KV cache (pause_generation(mode="keep",
        clear_cache=False))."""

    def stage(self, weights: Weights, group: TransferGroup | None) -> Staged:
        """Make ``weights`` ready to swap in while generation goes on, or raise: read their file once into host
        memory, hashing it, and check the digest; given a transfer ``group``, check what the trainer will send
        (the transfer itself is the swap)."""

    def swap(self, staged: Staged) -> None:
        """Put the staged weights in place (paused, no file read), or raise: load the in-memory copy, or take
        part in the transfer group at its rank (receive, or send as rank 0)."""

    def resume(self) -> None:
        """Continue the paused requests under the loaded weights (resume_generation())."""


@dataclass
class AgentCore:
    engine: Engine
    loaded: Weights | None = None
    paused: bool = False
    last_ack: Ack | None = None
    swapped: Staged | None = None
    """What the last swap took its weights from, held until ``release``: freeing a staged gigabyte takes a tenth
    of a second, which the pause need not wait for."""
    releasing: threading.Thread | None = None
    timed_barrier: str | None = None
    """The barrier whose steps ``timings`` holds."""
    timings: dict[MemberStep, StepTimes] = field(default_factory=dict)
    """When each step of that barrier began and ended (a retried step: its last try); every ack carries them."""

    def start(self, initial: Weights | None) -> None:
        """Load the weights the job had committed when this pod was created, before reporting ready."""
        if initial is not None:
            with contextlib.closing(self.engine.stage(initial, None)) as staged:
                self.engine.swap(staged)
            self.loaded = initial

    def release(self) -> None:
        """Free what the last swap took its weights from, on a thread of its own (the caller goes on); the shell
        calls it once the ack is written. The next staging waits for it: at most one staged copy is held."""
        staged, self.swapped = self.swapped, None
        if staged is not None:
            self.releasing = threading.Thread(target=staged.close, name="release-staged-weights", daemon=True)
            self.releasing.start()

    def _swap_in(self, weights: Weights, group: TransferGroup | None) -> None:
        """Stage ``weights`` (generating still), then pause and swap them in; keep the staged copy for release."""
        self.release()
        if self.releasing is not None:
            self.releasing.join()
        with self._timed(MemberStep.STAGE):
            staged = self.engine.stage(weights, group)
        try:
            self._pause()
            with self._timed(MemberStep.LOAD):
                self.engine.swap(staged)
        except BaseException:
            staged.close()
            raise
        self.swapped = staged
        self.loaded = weights

    def handle(self, command: Command) -> Ack:
        """Carry out ``command`` once; return the ack to write."""
        done = ACK_FOR[command.phase]
        last = self.last_ack
        if last is not None and (last.id, last.phase, last.retry) == (command.id, done, command.retry):
            return last  # carried out already; a new retry of a command that failed is carried out again
        if command.id != self.timed_barrier:
            self.timed_barrier, self.timings = command.id, {}
        weights = Weights(version=command.version, uri=command.uri, digest=command.digest)
        error = None
        try:
            holds = self.loaded is not None and (self.loaded.version, self.loaded.digest) == (
                weights.version,
                weights.digest,
            )
            if command.phase is not BarrierPhase.PAUSE and (not holds or command.group is not None):
                # Staged while the engine still generates; paused only for the swap. An agent that restarted
                # mid-barrier may see Update or Resume first: it still stages, pauses, swaps and resumes in that
                # order. A member of a transfer group always takes part.
                self._swap_in(weights, command.group)
            self._pause()
            if command.phase is BarrierPhase.RESUME:
                with self._timed(MemberStep.RESUME):
                    self.engine.resume()
                self.paused = False
        except Exception as failure:  # the operator decides: fail the job or evict this pod
            error = f"{type(failure).__name__}: {failure}"
            logger.error(
                "barrier %s, phase %s failed on this pod (%s); the operator retries it or replaces this member",
                command.id,
                command.phase.value,
                error,
            )
            logger.debug("the failure's traceback", exc_info=True)
        self.last_ack = Ack(
            id=command.id,
            phase=done,
            loaded_version=self.loaded.version if self.loaded else None,
            digest=self.loaded.digest if self.loaded else None,
            error=error,
            retry=command.retry,
            timings=dict(self.timings),
        )
        return self.last_ack

    def resumed(self, version: int) -> bool:
        """Whether this member's last ack says it resumed ``version`` or a newer one."""
        ack = self.last_ack
        return ack is not None and ack.phase is ACK_FOR[BarrierPhase.RESUME] and (ack.loaded_version or 0) >= version

    def _pause(self) -> None:
        if not self.paused:
            with self._timed(MemberStep.PAUSE):
                self.engine.pause()
            self.paused = True

    @contextlib.contextmanager
    def _timed(self, step: MemberStep) -> Iterator[None]:
        """Record when ``step`` of the current barrier began and ended, whether it succeeded or raised."""
        started = time.time()
        try:
            yield
        finally:
            self.timings[step] = StepTimes(start=started, end=time.time())
