"""The rollout producer: trainer rank 0 keeps prompt groups in flight on the actors while it learns, publishes and
the actors take weight updates, within spec.trainer.maxLag (PipelineRL's design; maxLag 0 is synchronous RL).

Prompts are numbered by their position in the job's sequence of prompts: each step owns promptsPerStep positions
(and with dynamic sampling, spec.trainer.rollout.dynamicSampling, maxExtraGroups more): position p belongs to step
p // (its positions per step) + 1, which learns it with the weights version of the step before (step - 1), so its
tokens may be sampled under versions step - 1 - maxLag or newer. The pure core (``Schedule``) decides:
- which position to sample next: the lowest of those dropped as stale, the extra ones due and the next in order
  (the dataset's order);
- whether sampling it now can still yield a group within maxLag: only once the actors serve version
  step - 1 - maxLag; before that, every group it could finish would be dropped, so nothing is sent;
- a step's last spec.trainer.rollout.onPolicyGroups positions are held to a lag of 0: they are sent once the actors
  serve the step's own version (step - 1) and sampled wholly under it, since the next version is published only
  after the step learns; their tokens measure the train-inference mismatch every step, whatever maxLag is;
- at most spec.trainer.rollout.groupsInFlight groups are in flight on the actors at once;
- a finished group with a token more than maxLag versions behind its step's version is dropped, counted and its
  prompt sampled again (at most ``STALE_RESAMPLINGS`` times); the others wait, scored, until their step takes them;
- with dynamic sampling, a finished group whose rewards are all equal (no signal) makes the step's next extra
  position due, held to the lag bound of the group it replaces, until the step has spent maxExtraGroups.
A step takes its own promptsPerStep positions, in order, as soon as all are finished (with dynamic sampling: those
with signal among its regular and needed extra positions, filled up to promptsPerStep with the earliest without
when the extra ones ran out): without dynamic sampling the batch of a step is the same whatever the timings (maxLag
0 gives the serial loop's), and the next step's position is a function of the step either way, which the published
weights and checkpoints record; rows sampled but not learned when a trainer stops are sampled again by the trainer
that resumes. The finished groups waiting are at most (maxLag + 1) times the positions per step: a position is sent
only once its step is within maxLag + 1 of the version the actors serve.

The shell (``RolloutProducer``) runs the core on an event loop in a thread of its own, with the actors' client
(lockstep_workers.rollout.client: its retries, so a lost actor costs retries, not the step) and the reward; evaluation
requests go through the same loop, beside the training requests, which they never stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from lockstep_workers.rollout.client import STALE_RESAMPLINGS, VERSION_POLL_SECONDS, Actors, RolloutError
from lockstep_workers.rollout.dataset import Prompt
from lockstep_workers.rollout.record import Rollout, lag_of
from lockstep_workers.rollout.scoring import RewardInput, Scores

logger = logging.getLogger("lockstep.trainer")

T = TypeVar("T")


def informative(rewards: Sequence[float]) -> bool:
    """Whether a group's rewards carry a learning signal: not all equal (equal rewards give every sample the same
    advantage, 0 against the group's baseline; reinforce_plus_plus has none, and filters them all the same)."""
    return len(set(rewards)) > 1


@dataclass(frozen=True)
class StepGroups:
    """What a step takes: the groups it learns, in position order, and with dynamic sampling what that cost."""

    groups: list[Any]
    dropped: int = 0
    """Groups sampled for the step whose rewards were all equal, not learned."""
    extra: int = 0
    """Groups sampled beyond promptsPerStep."""
    unfilled: int = 0
    """Groups with equal rewards learned anyway, because the step spent its extra groups short of promptsPerStep
    groups with signal."""


@dataclass
class Schedule:
    """The producer's decisions, without I/O: positions from ``start`` (inclusive) to ``end`` (exclusive), each
    step owning ``prompts_per_step + extra_groups`` of them."""

    prompts_per_step: int
    max_lag: int
    groups_in_flight: int
    start: int
    end: int
    on_policy_groups: int = 0
    """How many of each step's positions, its last regular ones, are held to a lag of 0."""
    extra_groups: int = 0
    """Dynamic sampling's bound (spec.trainer.rollout.maxExtraGroups; 0: off): a step's positions after its
    ``prompts_per_step`` regular ones are sampled only in place of groups found uninformative, one per such group,
    in order."""
    next_position: int = -1
    """The next regular position to send."""
    dropped: list[int] = field(default_factory=list)
    """Positions dropped as stale, to be sampled again before any new one."""
    resamplings: dict[int, int] = field(default_factory=dict)
    in_flight: set[int] = field(default_factory=set)
    finished: dict[int, Any] = field(default_factory=dict)
    """Position -> its finished group, until its step takes it."""
    uninformative: set[int] = field(default_factory=set)
    """Finished positions whose rewards are all equal (dynamic sampling)."""
    extra_bounds: dict[int, int] = field(default_factory=dict)
    """Extra position -> its lag bound, the bound of the group it replaces, from when its step needs it."""
    extras_due: list[int] = field(default_factory=list)
    """Extra positions needed and not yet sent."""

    def __post_init__(self) -> None:
        if self.next_position < 0:
            self.next_position = self.start

    @property
    def slots(self) -> int:
        """Positions per step: the regular ones and the extra ones."""
        return self.prompts_per_step + self.extra_groups

    def step_of(self, position: int) -> int:
        return position // self.slots + 1

    def version_of(self, position: int) -> int:
        """The weights version the group at ``position`` is learned with."""
        return self.step_of(position) - 1

    def candidate(self) -> int | None:
        """The position to sample next, whatever the actors serve: the lowest of those dropped as stale, the extra
        ones due and the next regular one; None when none is left or enough are in flight."""
        if len(self.in_flight) >= self.groups_in_flight:
            return None
        regular = [self.next_position] if self.next_position < self.end else []
        return min([*self.dropped, *self.extras_due, *regular], default=None)

    def lag_bound(self, position: int) -> int:
        """How many versions behind its step's version a token of ``position`` may be: maxLag, 0 for the step's
        on-policy positions, an extra position's that of the group it replaces."""
        index = position % self.slots
        if index >= self.prompts_per_step:
            return self.extra_bounds[position]
        on_policy = index >= self.prompts_per_step - self.on_policy_groups
        return 0 if on_policy else self.max_lag

    def within_lag(self, position: int, served: int) -> bool:
        """Whether a group of ``position`` sampled from actors serving ``served`` can be learned within its bound."""
        return self.version_of(position) - served <= self.lag_bound(position)

    def next_submission(self, served: int) -> int | None:
        """The position to send now, the actors serving ``served``; None: nothing to send now."""
        position = self.candidate()
        return position if position is not None and self.within_lag(position, served) else None

    def submitted(self, position: int) -> None:
        if position in self.dropped:
            self.dropped.remove(position)
        elif position in self.extras_due:
            self.extras_due.remove(position)
        else:
            assert position == self.next_position, (position, self.next_position)
            following = position + 1
            if following % self.slots >= self.prompts_per_step:  # past the step's regular positions: the next step's
                following = self.step_of(position) * self.slots
            self.next_position = following
        self.in_flight.add(position)

    def is_stale(self, position: int, lag: int) -> bool:
        """Whether a group whose oldest token is ``lag`` versions behind its step's version must be dropped."""
        return lag > self.lag_bound(position)

    def drop(self, position: int) -> None:
        """The group of ``position`` came back stale: sample its prompt again (RolloutError after too many)."""
        self.in_flight.discard(position)
        self.resamplings[position] = self.resamplings.get(position, 0) + 1
        if self.resamplings[position] > STALE_RESAMPLINGS:
            raise RolloutError(
                f"the group of position {position} was still more than {self.lag_bound(position)} versions "
                f"behind weights version {self.version_of(position)} after {STALE_RESAMPLINGS} resamplings: the "
                "actors report a version within the bound but sample under an older one"
            )
        self.dropped.append(position)

    def finish(self, position: int, group: Any, has_signal: bool = True) -> None:
        """The group of ``position`` is finished and scored; one without signal (``informative``) is replaced by
        the step's next extra position, while it has one."""
        self.in_flight.discard(position)
        self.finished[position] = group
        if has_signal or not self.extra_groups:
            return
        self.uninformative.add(position)
        first = (self.step_of(position) - 1) * self.slots + self.prompts_per_step
        extra = next((p for p in range(first, first + self.extra_groups) if p not in self.extra_bounds), None)
        if extra is not None:
            self.extra_bounds[extra] = self.lag_bound(position)
            self.extras_due.append(extra)

    def positions(self, step: int) -> list[int]:
        """Step ``step``'s positions sampled or to be sampled: its regular ones and the extra ones it needs."""
        first = (step - 1) * self.slots
        regular = range(first, first + self.prompts_per_step)
        return [*regular, *sorted(p for p in self.extra_bounds if self.step_of(p) == step)]

    def ready(self, step: int) -> bool:
        return all(p in self.finished for p in self.positions(step))

    def take(self, step: int) -> StepGroups:
        """Step ``step``'s groups (all finished: ``ready``): those with signal, and when the extra positions ran out
        short of ``prompts_per_step`` of them, the earliest without, in position order."""
        positions = self.positions(step)
        groups = {p: self.finished.pop(p) for p in positions}
        dropped = [p for p in positions if p in self.uninformative]
        unfilled = self.prompts_per_step - (len(positions) - len(dropped))
        assert unfilled >= 0, (step, positions, dropped)
        learned = sorted({*positions} - {*dropped[unfilled:]})
        for position in positions:
            self.resamplings.pop(position, None)
            self.uninformative.discard(position)
            self.extra_bounds.pop(position, None)
        return StepGroups(
            [groups[p] for p in learned], len(dropped) - unfilled, len(positions) - self.prompts_per_step, unfilled
        )

    def exhausted(self) -> bool:
        return self.next_position >= self.end and not self.dropped and not self.extras_due and not self.in_flight


@dataclass(frozen=True)
class Group:
    """One prompt's finished, scored samples (their ``group`` is 0)."""

    position: int
    rollouts: list[Rollout]
    inputs: list[RewardInput]
    rewards: list[float]
    reward_errors: int
    reward_parts: dict[str, list[float]] = field(default_factory=dict)
    """Each reward function's own rewards, by name (spec.trainer.rewards)."""


Score = Callable[[list[Rollout], Prompt], tuple[list[RewardInput], Scores]]
"""score(rollouts, prompt) -> what the reward saw of each, and their rewards."""


@dataclass
class Counts:
    """What the producer did so far."""

    tokens_generated: int = 0
    samples_dropped: int = 0
    requests: dict[str, int] = field(default_factory=lambda: {"train": 0, "eval": 0})
    """Requests sent so far, by tag: training groups and evaluation batches."""


class RolloutProducer:
    """``Schedule`` run against ``actors`` on an event loop in a thread, from ``start()`` until ``close()``."""

    def __init__(
        self,
        actors: Actors,
        schedule: Schedule,
        prompt_of: Callable[[int], Prompt],
        samples: int,
        sampling: dict[str, Any],
        score: Score,
    ) -> None:
        """``prompt_of(position)``: the prompt at a position; ``samples`` completions each."""
        self.actors = actors
        self.schedule = schedule
        self.prompt_of = prompt_of
        self.samples = samples
        self.sampling = sampling
        self.score = score
        self.counts = Counts()
        self.served = -1
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="rollout-producer", daemon=True)
        self._changed: asyncio.Condition | None = None
        self._step_asked: asyncio.Event | None = None
        self._main: asyncio.Task[None] | None = None
        self._failure: BaseException | None = None

    def start(self) -> None:
        self.thread.start()
        self._main = self._call(self._start())

    async def _start(self) -> asyncio.Task[None]:
        return asyncio.create_task(self._produce())

    def close(self) -> None:
        """Cancel what is in flight, wait until it is, and stop the thread."""
        if self._main is not None:
            self._call(self._cancel(self._main))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()

    @staticmethod
    async def _cancel(task: asyncio.Task[None]) -> None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    def _call(self, work: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(work, self.loop).result()

    def take(self, step: int) -> StepGroups:
        """Block until step ``step``'s groups are finished; return those it learns (``Group``s, in position order).
        Raises what stopped the producer (RolloutError, RewardFailed)."""
        return self._call(self._take(step))

    def evaluate(self, prompts: Sequence[list[int]], sampling: dict[str, Any]) -> list[Rollout]:
        """One completion of each prompt, sampled beside the training requests (tagged eval)."""
        self.counts.requests["eval"] += 1
        return self._call(self.actors.generate(prompts, 1, sampling))

    def busy_seconds(self) -> dict[str, float]:
        """Each actor's busy seconds so far (its own count)."""
        return self._call(self.actors.busy_seconds())

    async def _condition(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    async def _notify(self) -> None:
        changed = await self._condition()
        async with changed:
            changed.notify_all()

    def _asked(self) -> asyncio.Event:
        """Set when a step asks for its groups: the actors may serve a newer version by then."""
        if self._step_asked is None:
            self._step_asked = asyncio.Event()
        return self._step_asked

    async def _take(self, step: int) -> StepGroups:
        self._asked().set()
        changed = await self._condition()
        async with changed:
            await changed.wait_for(lambda: self._failure is not None or self.schedule.ready(step))
        if self._failure is not None:
            raise self._failure
        taken = self.schedule.take(step)
        await self._notify()
        return taken

    async def _produce(self) -> None:
        try:
            self.served = await self.actors.served_version()
            async with asyncio.TaskGroup() as requests:
                while not self.schedule.exhausted():
                    position = self.schedule.next_submission(self.served)
                    if position is not None:
                        self.schedule.submitted(position)
                        self.counts.requests["train"] += 1
                        requests.create_task(self._sample(position))
                    elif self.schedule.candidate() is not None:  # held back by maxLag: ask the actors again
                        served = await self.actors.served_version()
                        if served == self.served:  # until a step asks for its groups, or after a while
                            with contextlib.suppress(TimeoutError):
                                await asyncio.wait_for(self._asked().wait(), VERSION_POLL_SECONDS)
                            self._asked().clear()
                        self.served = served
                    else:  # enough in flight: wait for one to finish
                        changed = await self._condition()
                        async with changed:
                            await changed.wait()
        except asyncio.CancelledError:
            raise
        except BaseException as error:  # handed to the trainer's thread by ``take``
            self._failure = error.exceptions[0] if isinstance(error, BaseExceptionGroup) else error
            await self._notify()

    async def _sample(self, position: int) -> None:
        prompt = self.prompt_of(position)
        rollouts = await self.actors.generate([prompt.token_ids], self.samples, self.sampling, [prompt.row])
        self.counts.tokens_generated += sum(len(r.completion) for r in rollouts)
        version = self.schedule.version_of(position)
        lag = max(lag_of(r, version) for r in rollouts)
        if self.schedule.is_stale(position, lag):
            logger.warning(
                "dropped the %d sample(s) of position %d, up to %d version(s) behind %d: sampling again",
                len(rollouts),
                position,
                lag,
                version,
            )
            self.counts.samples_dropped += len(rollouts)
            self.schedule.drop(position)
        else:
            inputs, scores = await asyncio.to_thread(self.score, rollouts, prompt)
            group = Group(position, rollouts, inputs, scores.rewards, scores.errors, scores.parts)
            self.schedule.finish(position, group, informative(scores.rewards))
        await self._notify()
