"""The rollout producer (lockstep_workers.rollout.producer): its schedule, simulated over random sample and learn
latencies and stops, keeps every learned token within maxLag, samples each step's on-policy groups under the step's own
version, learns each group once and each row of an epoch once; the
producer drops a stale group and samples its prompt again, interleaves evaluation with training, and hands what
stopped it to the step that waits."""

from __future__ import annotations

import asyncio
import heapq
import threading
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lockstep_workers.rollout.client import STALE_RESAMPLINGS, RolloutError, Rows
from lockstep_workers.rollout.dataset import Prompt, step_rows
from lockstep_workers.rollout.producer import RolloutProducer, Schedule, StepGroups, informative
from lockstep_workers.rollout.record import Rollout
from lockstep_workers.rollout.scoring import Scores


def simulate(
    prompts_per_step: int,
    max_lag: int,
    in_flight: int,
    first_step: int,
    last_step: int,
    sample_seconds: Sequence[float],
    learn_seconds: Sequence[float],
    lagging: set[int],
    on_policy_groups: int = 0,
    extra_groups: int = 0,
    uninformative: frozenset[int] = frozenset(),
    taken: dict[int, StepGroups] | None = None,
    bounds: dict[int, int] | None = None,
) -> list[tuple[int, int, int]]:
    """The schedule driven by a discrete-event model of the actors and the learner from ``first_step`` (the actors
    serving version first_step - 1) through ``last_step``: each group takes the next of ``sample_seconds``, each
    step's learning the next of ``learn_seconds``, then its version is served at once. A group's oldest token is
    the version served when it was sent, one older on its first try at a ``lagging`` position (an actor that
    reports a version but samples under an older one). With ``extra_groups`` (dynamic sampling), the groups of the
    positions in ``uninformative`` have equal rewards, every try. Returns (position, learning step, oldest version)
    of every learned group, in the order learned; each step's ``StepGroups`` go to ``taken``, each position's lag
    bound when sent to ``bounds``."""
    slots = prompts_per_step + extra_groups
    schedule = Schedule(
        prompts_per_step,
        max_lag,
        in_flight,
        (first_step - 1) * slots,
        last_step * slots,
        on_policy_groups=on_policy_groups,
        extra_groups=extra_groups,
    )
    taken = {} if taken is None else taken
    bounds = {} if bounds is None else bounds
    served, now, tries = first_step - 1, 0.0, 0
    events: list[tuple[float, int, str, int, int]] = []  # (time, order, kind, position or step, oldest version)
    learned: list[tuple[int, int, int]] = []
    learning, step = False, first_step
    sent: set[int] = set()
    while step <= last_step or learning:
        while (position := schedule.next_submission(served)) is not None:
            assert schedule.within_lag(position, served) and len(schedule.in_flight) < in_flight
            oldest = served - 1 if position in lagging and position not in sent else served
            sent.add(position)
            bounds[position] = schedule.lag_bound(position)
            schedule.submitted(position)
            tries += 1
            heapq.heappush(
                events, (now + sample_seconds[tries % len(sample_seconds)], tries, "sampled", position, oldest)
            )
        if not learning and step <= last_step and schedule.ready(step):
            taken[step] = schedule.take(step)
            for finished, oldest in taken[step].groups:
                learned.append((finished, step, oldest))
            learning = True
            heapq.heappush(events, (now + learn_seconds[step % len(learn_seconds)], -step, "learned", step, 0))
            continue
        assert events, "the pipeline stalled"
        now, _, kind, number, oldest = heapq.heappop(events)
        if kind == "sampled":
            if schedule.is_stale(number, schedule.version_of(number) - oldest):
                schedule.drop(number)
            else:
                schedule.finish(number, (number, oldest), number not in uninformative)
        else:
            learning, served, step = False, number, number + 1
    assert len(schedule.finished) <= (max_lag + 1) * slots, "the buffer is bounded by maxLag"
    return learned


latencies = st.lists(st.floats(0.01, 10.0), min_size=1, max_size=20)


@settings(max_examples=200, deadline=None)
@given(
    prompts_per_step=st.integers(1, 5),
    max_lag=st.integers(0, 3),
    in_flight=st.integers(1, 12),
    steps=st.integers(1, 8),
    stopped_after=st.integers(0, 8),
    sample_seconds=latencies,
    learn_seconds=latencies,
    lagging=st.sets(st.integers(0, 40), max_size=10),
    rows=st.integers(1, 30),
    on_policy_groups=st.integers(0, 5),
)
def test_every_learned_token_is_within_max_lag_and_each_group_and_row_is_learned_once(
    prompts_per_step: int,
    max_lag: int,
    in_flight: int,
    steps: int,
    stopped_after: int,
    sample_seconds: list[float],
    learn_seconds: list[float],
    lagging: set[int],
    rows: int,
    on_policy_groups: int,
) -> None:
    """A trainer stopped after step ``stopped_after`` (its sampled but unlearned groups lost) resumes from the next
    step: over both runs, no learned group is more than maxLag versions behind the weights it is learned with, each
    step's last ``on_policy_groups`` groups were sampled under the step's own version, every position is learned
    once, by its own step, and so every row of an epoch once."""
    stopped_after = min(stopped_after, steps)
    on_policy_groups = min(on_policy_groups, prompts_per_step)
    run = (prompts_per_step, max_lag, in_flight)
    timings = (sample_seconds, learn_seconds, lagging, on_policy_groups)
    learned = simulate(*run, 1, stopped_after, *timings) if stopped_after else []
    if stopped_after < steps:
        learned += simulate(*run, stopped_after + 1, steps, *timings)
    assert all((step - 1) - oldest <= max_lag for _, step, oldest in learned), "a token beyond maxLag was learned"
    on_policy = [
        (step, oldest)
        for position, step, oldest in learned
        if position % prompts_per_step >= prompts_per_step - on_policy_groups
    ]
    assert len(on_policy) == steps * on_policy_groups
    assert all(oldest == step - 1 for step, oldest in on_policy), "an on-policy group sampled under older weights"
    positions = [position for position, _, _ in learned]
    assert sorted(positions) == list(range(steps * prompts_per_step)), "a group learned twice, or never"
    assert all(position // prompts_per_step + 1 == step for position, step, _ in learned)
    order = [row for step in range(1, steps + 1) for row in step_rows(rows, 7, step, prompts_per_step)]
    for epoch in range(0, len(order), rows):
        whole = order[epoch : epoch + rows]
        assert len(set(whole)) == len(whole), "a row repeated within an epoch"
        assert len(whole) < rows or set(whole) == set(range(rows)), "a row skipped within an epoch"


@settings(max_examples=200, deadline=None)
@given(
    prompts_per_step=st.integers(1, 5),
    extra_groups=st.integers(1, 5),
    max_lag=st.integers(0, 3),
    in_flight=st.integers(1, 12),
    steps=st.integers(1, 6),
    stopped_after=st.integers(0, 6),
    sample_seconds=latencies,
    learn_seconds=latencies,
    lagging=st.sets(st.integers(0, 60), max_size=10),
    uninformative=st.frozensets(st.integers(0, 60)),
    on_policy_groups=st.integers(0, 5),
)
def test_dynamic_sampling_learns_every_group_with_signal_and_replaces_the_others_within_the_bound(
    prompts_per_step: int,
    extra_groups: int,
    max_lag: int,
    in_flight: int,
    steps: int,
    stopped_after: int,
    sample_seconds: list[float],
    learn_seconds: list[float],
    lagging: set[int],
    uninformative: frozenset[int],
    on_policy_groups: int,
) -> None:
    """With dynamic sampling, across a stop and a resume: every step learns promptsPerStep groups of its own
    positions within maxLag; it samples one extra group per group without signal, at most maxExtraGroups, and
    learns every group with signal it sampled; it learns groups without signal only once its extra groups are
    spent; an extra group is held to the lag bound of the group it replaces, so a step whose extra groups did not
    run out learns exactly onPolicyGroups groups sampled under its own version."""
    stopped_after = min(stopped_after, steps)
    on_policy_groups = min(on_policy_groups, prompts_per_step)
    slots = prompts_per_step + extra_groups
    run = (prompts_per_step, max_lag, in_flight)
    taken: dict[int, StepGroups] = {}
    bounds: dict[int, int] = {}
    timings = (sample_seconds, learn_seconds, lagging, on_policy_groups, extra_groups, uninformative, taken, bounds)
    learned = simulate(*run, 1, stopped_after, *timings) if stopped_after else []
    if stopped_after < steps:
        learned += simulate(*run, stopped_after + 1, steps, *timings)
    assert sorted(taken) == list(range(1, steps + 1))
    assert all((step - 1) - oldest <= max_lag for _, step, oldest in learned), "a token beyond maxLag was learned"
    assert all(position // slots + 1 == step for position, step, _ in learned), "a group learned by another step"
    assert len({position for position, _, _ in learned}) == len(learned), "a group learned twice"
    for step, groups in taken.items():
        mine = [(position, oldest) for position, at, oldest in learned if at == step]
        assert len(mine) == prompts_per_step
        without_signal = sum(position in uninformative for position, _ in mine)
        assert without_signal == groups.unfilled
        assert groups.extra == min(groups.dropped + groups.unfilled, extra_groups)
        assert groups.unfilled == 0 or groups.extra == extra_groups, "a group without signal learned too soon"
        assert all(oldest == step - 1 for position, oldest in mine if bounds[position] == 0)
        if groups.unfilled == 0 and max_lag > 0:  # at maxLag 0 every group is on-policy
            assert sum(bounds[position] == 0 for position, _ in mine) == on_policy_groups


def test_a_group_without_signal_is_replaced_by_the_steps_next_extra_position_with_its_lag_bound() -> None:
    schedule = Schedule(2, max_lag=1, groups_in_flight=8, start=0, end=8, on_policy_groups=1, extra_groups=2)
    for position in (0, 1):
        schedule.submitted(position)
    assert schedule.candidate() == 4, "no extra position is sent before the step needs one"
    schedule.finish(1, "b", has_signal=False)
    assert schedule.candidate() == 2 and schedule.lag_bound(2) == 0, "the on-policy group's replacement is on-policy"
    assert not schedule.ready(1)
    schedule.submitted(2)
    schedule.finish(0, "a")
    schedule.finish(2, "c")
    taken = schedule.take(1)
    assert (taken.groups, taken.dropped, taken.extra, taken.unfilled) == (["a", "c"], 1, 1, 0)


def test_a_step_that_spent_its_extra_groups_learns_its_earliest_groups_without_signal() -> None:
    schedule = Schedule(2, max_lag=0, groups_in_flight=8, start=0, end=3, extra_groups=1)
    for position in (0, 1):
        schedule.submitted(position)
        schedule.finish(position, position, has_signal=False)
    assert schedule.next_submission(served=0) == 2
    schedule.submitted(2)
    schedule.finish(2, 2, has_signal=False)
    assert schedule.ready(1) and schedule.exhausted()
    taken = schedule.take(1)
    assert (taken.groups, taken.dropped, taken.extra, taken.unfilled) == ([0, 1], 1, 1, 2)


@given(st.lists(st.floats(-2, 2), min_size=1, max_size=8))
def test_a_group_has_signal_unless_its_rewards_are_all_equal(rewards: list[float]) -> None:
    assert informative(rewards) == (max(rewards) != min(rewards))


def test_max_lag_0_sends_a_step_only_once_the_actors_serve_the_previous_version() -> None:
    schedule = Schedule(prompts_per_step=2, max_lag=0, groups_in_flight=8, start=2, end=8)
    assert schedule.next_submission(served=0) is None, "step 2 is learned with version 1"
    assert schedule.next_submission(served=1) == 2
    for position in (2, 3):
        schedule.submitted(position)
    assert schedule.next_submission(served=1) is None, "step 3 needs version 2"
    ahead = Schedule(prompts_per_step=2, max_lag=1, groups_in_flight=8, start=2, end=8)
    for position in (2, 3):
        ahead.submitted(position)
    assert ahead.next_submission(served=1) == 4, "maxLag 1: step 3 is sampled while step 2 learns"


class Actors:
    """Fake actors serving ``served``, 4 tokens a completion: the first group of a prompt in ``first_versions``
    comes back under those versions; evaluation prompts ([0]) are answered while training requests wait on
    ``release``."""

    def __init__(self, served: int, first_versions: dict[int, list[int]] | None = None) -> None:
        self.served = served
        self.first_versions = first_versions or {}
        self.calls: list[int] = []
        self.release = threading.Event()
        self.held = threading.Semaphore(0)
        """Released once for each training request the actors hold."""

    def wait_until_ready(self) -> None: ...

    def wait_for_version(self, version: int) -> None: ...

    async def served_version(self) -> int:
        return self.served

    async def busy_seconds(self) -> dict[str, float]:
        return {"http://actor": 1.0}

    async def generate(
        self, prompts: Sequence[list[int]], group: int, sampling: dict[str, Any], rows: Rows = None
    ) -> list[Rollout]:
        [prompt] = prompts
        if prompt != [0]:
            self.held.release()
            await asyncio.to_thread(self.release.wait)
            self.calls.append(prompt[0])
        first = self.calls.count(prompt[0]) == 1
        versions = self.first_versions.get(prompt[0], [self.served] * 4) if first else [self.served] * 4
        completion = [7] * len(versions)
        return [Rollout(list(prompt), completion, [0.0] * len(completion), 0, versions) for _ in range(group)]


def producer_of(actors: Actors, schedule: Schedule) -> RolloutProducer:
    def score(rollouts: list[Rollout], prompt: Prompt) -> tuple[list[Any], Scores]:
        return [prompt.row] * len(rollouts), Scores([1.0] * len(rollouts), {}, 0)

    return RolloutProducer(actors, schedule, lambda p: Prompt([100 + p], str(p), {"p": p}), 2, {}, score)


def test_a_stale_group_is_dropped_counted_and_its_prompt_sampled_again() -> None:
    """Step 6 learns with version 5 under maxLag 1: position 10's first group has a token two versions behind (3),
    so it is dropped (2 samples) and sampled again; a token one behind (4) is kept."""
    actors = Actors(served=5, first_versions={110: [3, 4, 5, 5], 111: [4, 5, 5, 5]})
    actors.release.set()
    producer = producer_of(actors, Schedule(2, 1, 4, start=10, end=12))
    producer.start()
    try:
        groups = producer.take(6).groups
    finally:
        producer.close()
    assert [g.position for g in groups] == [10, 11]
    assert producer.counts.samples_dropped == 2 and sorted(actors.calls) == [110, 110, 111]
    assert [min(r.versions) for g in groups for r in g.rollouts] == [5, 5, 4, 4]


def test_the_producer_samples_an_extra_prompt_in_place_of_a_group_whose_rewards_are_all_equal() -> None:
    """Dynamic sampling: position 1's prompt scores the same for every sample, so the step's extra position 2 is
    sampled, and the step learns positions 0 and 2."""
    actors = Actors(served=0)
    actors.release.set()

    def score(rollouts: list[Rollout], prompt: Prompt) -> tuple[list[Any], Scores]:
        rewards = [1.0] * len(rollouts) if prompt.row["p"] == 1 else [float(n) for n in range(len(rollouts))]
        return [prompt.row] * len(rollouts), Scores(rewards, {}, 0)

    schedule = Schedule(2, 0, 4, start=0, end=3, extra_groups=1)
    producer = RolloutProducer(actors, schedule, lambda p: Prompt([100 + p], str(p), {"p": p}), 2, {}, score)
    producer.start()
    try:
        taken = producer.take(1)
    finally:
        producer.close()
    assert [g.position for g in taken.groups] == [0, 2] and (taken.dropped, taken.extra) == (1, 1)
    assert sorted(actors.calls) == [100, 101, 102]


def test_a_group_stale_after_every_resampling_stops_the_step_that_waits_for_it() -> None:
    schedule = Schedule(1, 0, 1, start=0, end=1)
    schedule.submitted(0)
    for _ in range(STALE_RESAMPLINGS):
        schedule.drop(0)
        schedule.submitted(0)
    with pytest.raises(RolloutError, match=r"after 3 resamplings"):
        schedule.drop(0)


def test_evaluation_is_answered_while_training_requests_are_in_flight() -> None:
    actors = Actors(served=0)
    producer = producer_of(actors, Schedule(2, 1, 4, start=0, end=4))
    producer.start()
    try:
        for _ in range(4):  # steps 1 and 2 (maxLag 1, version 0 served) are sent, and held
            actors.held.acquire()
        [evaluated] = producer.evaluate([[0]], {})
        assert evaluated.prompt == [0] and actors.calls == [], "answered while every training request is held"
        assert producer.counts.requests == {"train": 4, "eval": 1}
        actors.release.set()
        groups = producer.take(1).groups + producer.take(2).groups
    finally:
        producer.close()
    assert [g.position for g in groups] == [0, 1, 2, 3] and all(g.rewards == [1.0, 1.0] for g in groups)


def test_what_stops_the_producer_stops_the_step_that_waits() -> None:
    class Failing(Actors):
        async def generate(
            self, prompts: Sequence[list[int]], group: int, sampling: dict[str, Any], rows: Rows = None
        ) -> list[Rollout]:
            raise RolloutError("a sample failed on 4 tries")

    producer = producer_of(Failing(0), Schedule(1, 0, 1, start=0, end=2))
    producer.start()
    try:
        with pytest.raises(RolloutError, match="a sample failed on 4 tries"):
            producer.take(1)
    finally:
        producer.close()
