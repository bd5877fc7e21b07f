"""The barrier agent that runs in each member pod (docs/barrier-protocol.md).

``AgentCore`` decides what to do with a command and remembers what it did, so a re-delivered
command is acked again but never paused for or loaded twice. ``PodAgent`` is its shell: it
watches only its own pod (a field selector), and writes only its own ack annotation.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Protocol

from lockstep import keys
from lockstep.api import Ack, BarrierPhase, Command, Weights
from lockstep.barrier import ACK_FOR

logger = logging.getLogger("lockstep.agent")


class Engine(Protocol):
    """What the agent drives: the vLLM actor implements it (and the trainer, for the NCCL sender side)."""

    def pause(self) -> None:
        """Stop scheduling; keep in-flight requests and the KV cache (pause_generation(mode="keep",
        clear_cache=False))."""

    def load(self, weights: Weights) -> None:
        """Load ``weights`` (checking the digest); raise on failure."""

    def resume(self) -> None:
        """Continue the paused requests under the loaded weights (resume_generation())."""


@dataclass
class AgentCore:
    engine: Engine
    loaded: Weights | None = None
    paused: bool = False
    last_ack: Ack | None = None

    def start(self, initial: Weights | None) -> None:
        """Load the weights the job had committed when this pod was created, before reporting ready."""
        if initial is not None:
            self.engine.load(initial)
            self.loaded = initial

    def handle(self, command: Command) -> Ack:
        """Carry out ``command`` once; return the ack to write."""
        done = ACK_FOR[command.phase]
        if self.last_ack is not None and self.last_ack.id == command.id and self.last_ack.phase == done:
            return self.last_ack
        weights = Weights(version=command.version, uri=command.uri, digest=command.digest)
        error = None
        try:
            self._pause()
            if command.phase is not BarrierPhase.PAUSE and self.loaded != weights:
                # An agent that restarted mid-barrier may see Update or Resume first: it still
                # pauses, loads and resumes in that order.
                self.engine.load(weights)
                self.loaded = weights
            if command.phase is BarrierPhase.RESUME:
                self.engine.resume()
                self.paused = False
        except Exception as failure:  # the operator decides: fail the job or evict this pod
            logger.exception("barrier %s, phase %s failed", command.id, command.phase.value)
            error = f"{type(failure).__name__}: {failure}"
        self.last_ack = Ack(
            id=command.id,
            phase=done,
            loaded_version=self.loaded.version if self.loaded else None,
            digest=self.loaded.digest if self.loaded else None,
            error=error,
        )
        return self.last_ack

    def _pause(self) -> None:
        if not self.paused:
            self.engine.pause()
            self.paused = True


def ack_annotation(ack: Ack) -> str:
    return json.dumps(ack.model_dump(mode="json", by_alias=True), sort_keys=True, separators=(",", ":"))


def command_from(annotations: dict[str, Any]) -> Command | None:
    """The command on a pod, or None when there is none or it cannot be read (logged)."""
    text = annotations.get(keys.BARRIER)
    if text is None:
        return None
    try:
        return Command.model_validate(json.loads(text))
    except ValueError as error:
        logger.error("ignoring an unreadable barrier command %r: %s", text, error)
        return None
