"""The rollout client against local aiohttp servers standing in for actors that answer, fail, time out, answer
slowly, refuse, or die in the middle of a step."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from aiohttp import web

from lockstep_workers.episodes import Client, Episode, Generation, episode_rollout
from lockstep_workers.rollout import client as rollouts
from lockstep_workers.rollout.client import (
    ActorPool,
    ActorService,
    FixedActors,
    RolloutError,
    actor_endpoints,
    collect_rollouts,
)

SAMPLING = {"max_tokens": 3}


@dataclass
class FakeActor:
    """An actor's /generate and /ready: ``behaviour`` is ok, fail (500; /ready 503), hang (neither answers), slow,
    or refuse (400)."""

    behaviour: str = "ok"
    version: int = 0
    moe_layers: int = 0
    """With MoE layers, each answer has the routed experts of its sequence, as vLLM gives them (prompt + completion
    - 1 tokens, top-2): token n's are (n, n + 1) in every layer."""
    served: int = 0
    received: int = 0
    asked_ready: int = 0
    runner: web.AppRunner | None = None
    url: str = ""
    in_flight: list[asyncio.Event] = field(default_factory=list)

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.received += 1
        if self.behaviour == "fail":
            return web.json_response({"error": "engine dead"}, status=500)
        if self.behaviour == "refuse":
            return web.json_response({"error": "sampling.n: the actor returns one completion per request"}, status=400)
        if self.behaviour == "hang":
            await asyncio.sleep(60)
        if self.behaviour == "slow":
            await asyncio.sleep(0.3)
        self.served += 1
        tokens = [body["prompt_token_ids"][-1] + 1] * body["sampling"]["max_tokens"]  # the last token's successor
        answer = {
            "token_ids": tokens,
            "logprobs": [-1.0] * len(tokens),
            "weights_versions": [self.version] * len(tokens),
        }
        if self.moe_layers:
            routed = len(body["prompt_token_ids"]) + len(tokens) - 1
            answer["routed_experts"] = [[[n, n + 1]] * self.moe_layers for n in range(routed)]
        return web.json_response(answer)

    async def ready(self, _: web.Request) -> web.Response:
        self.asked_ready += 1
        if self.behaviour == "hang":
            await asyncio.sleep(60)
        return web.json_response({"version": self.version}, status=503 if self.behaviour == "fail" else 200)

    async def start(self, port: int = 0) -> FakeActor:
        app = web.Application()
        app.add_routes([web.post("/generate", self.generate), web.get("/ready", self.ready)])
        self.runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", port)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self

    async def stop(self) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


@dataclass
class Listed:
    """Discovery that lists the given URLs with their readiness (what EndpointSlices would say)."""

    urls: dict[str, bool]

    def endpoints(self) -> Mapping[str, bool]:
        return self.urls


PROMPTS = [[1, 10], [1, 20], [1, 30], [1, 40]]
GROUP = 4


def assert_complete(sampled: list[Any]) -> None:
    assert len(sampled) == len(PROMPTS) * GROUP
    assert Counter(r.group for r in sampled) == dict.fromkeys(range(len(PROMPTS)), GROUP)
    assert all(r.completion == [r.prompt[-1] + 1] * 3 for r in sampled)


@pytest.fixture(autouse=True)
def quick_probes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rollouts, "PROBE_SECONDS", 0.05)
    monkeypatch.setattr(rollouts, "PROBE_TIMEOUT_SECONDS", 0.2)


def test_each_request_goes_to_the_usable_actor_with_the_fewest_outstanding() -> None:
    pool = ActorPool(listed=frozenset({"a", "b", "c"}), failed={"c"}, outstanding=Counter({"a": 3, "b": 1, "c": 0}))
    assert pool.choose() == "b", "c failed; b has fewer outstanding than a"
    assert pool.choose(tried=["b"]) == "a", "a retry goes to an actor not tried yet"
    assert pool.choose(tried=["a", "b"]) == "b", "all tried: the least loaded again"
    assert ActorPool().choose() is None


def test_requests_are_spread_over_healthy_actors() -> None:
    async def scenario() -> None:
        actors = [await FakeActor().start() for _ in range(2)]
        pool = ActorPool()
        sampled = await collect_rollouts(FixedActors([a.url for a in actors]), PROMPTS, GROUP, SAMPLING, pool=pool)
        assert_complete(sampled)
        assert [a.served for a in actors] == [8, 8], "all sent at once: fewest outstanding alternates"
        assert not pool.failed
        for actor in actors:
            await actor.stop()

    asyncio.run(scenario())


@pytest.mark.parametrize("behaviour", ["fail", "hang"])
def test_a_failing_or_silent_actor_costs_retries_not_the_step(behaviour: str) -> None:
    async def scenario() -> None:
        bad, good = await FakeActor(behaviour).start(), await FakeActor().start()
        pool = ActorPool()
        discovery = FixedActors([bad.url, good.url])
        sampled = await collect_rollouts(discovery, PROMPTS, GROUP, SAMPLING, pool=pool, request_timeout=0.5)
        assert_complete(sampled)
        assert good.served == 16 and bad.served == 0
        assert 1 <= bad.received <= 8, "only the requests sent before it was found out"
        assert pool.failed == {bad.url}, "out of the pool: its /ready does not answer 200"
        second = await collect_rollouts(discovery, PROMPTS, GROUP, SAMPLING, pool=pool, request_timeout=0.5)
        assert_complete(second)
        assert bad.received <= 8, "the next step sends it nothing while it is out"
        await bad.stop()
        await good.stop()

    asyncio.run(scenario())


def test_a_slow_actor_is_waited_for_within_the_timeout() -> None:
    async def scenario() -> None:
        slow, quick = await FakeActor("slow").start(), await FakeActor().start()
        pool = ActorPool()
        sampled = await collect_rollouts(FixedActors([slow.url, quick.url]), PROMPTS, GROUP, SAMPLING, pool=pool)
        assert_complete(sampled)
        assert slow.served == quick.served == 8 and not pool.failed
        await slow.stop()
        await quick.stop()

    asyncio.run(scenario())


def test_an_actor_lost_mid_step_costs_retries_and_returns_once_ready() -> None:
    async def scenario() -> None:
        doomed, survivor = await FakeActor("slow").start(), await FakeActor().start()
        port = int(doomed.url.rsplit(":", 1)[1])
        pool = ActorPool()
        discovery = FixedActors([doomed.url, survivor.url])
        step = asyncio.create_task(collect_rollouts(discovery, PROMPTS, GROUP, SAMPLING, pool=pool))
        await asyncio.sleep(0.1)
        await doomed.stop()  # its eight requests are in flight
        assert_complete(await step)
        assert doomed.served == 0 and survivor.served == 16
        assert pool.failed == {doomed.url}
        reborn = await FakeActor().start(port)  # the operator replaced it, on the same address
        assert_complete(await collect_rollouts(discovery, PROMPTS, GROUP, SAMPLING, pool=pool))
        assert not pool.failed and reborn.served == 8, "back in the pool once its /ready answered"
        await reborn.stop()
        await survivor.stop()

    asyncio.run(scenario())


def test_the_trainer_waits_for_the_oldest_actor_to_serve_a_version() -> None:
    """In a rolling update one actor may serve the new version while another still serves the old one."""

    async def scenario() -> None:
        first, second = sorted([await FakeActor().start(), await FakeActor().start()], key=lambda a: a.url)
        first.version, second.version = 2, 1  # the first listed already serves version 2
        waiting = asyncio.create_task(
            asyncio.to_thread(ActorService(FixedActors([first.url, second.url])).wait_for_version, 2)
        )
        while second.asked_ready < 2 and not waiting.done():  # it saw version 1 on the second actor, asked again
            await asyncio.sleep(0.01)
        assert not waiting.done(), "it returned while an actor still served version 1"
        second.version = 2
        await asyncio.wait_for(waiting, timeout=30)
        await first.stop()
        await second.stop()

    asyncio.run(scenario())


def test_an_actor_listed_not_ready_gets_nothing() -> None:
    async def scenario() -> None:
        unready, ready = await FakeActor().start(), await FakeActor().start()
        discovery = Listed({unready.url: False, ready.url: True})
        assert_complete(await collect_rollouts(discovery, PROMPTS, GROUP, SAMPLING))
        assert unready.received == 0 and ready.served == 16
        await unready.stop()
        await ready.stop()

    asyncio.run(scenario())


def test_a_malformed_request_fails_the_step_at_once_with_the_actors_message() -> None:
    async def scenario() -> None:
        refusing = await FakeActor("refuse").start()
        with pytest.raises(RolloutError, match=r"refused a request as malformed: .*sampling\.n"):
            await collect_rollouts(FixedActors([refusing.url]), PROMPTS, GROUP, SAMPLING)
        await refusing.stop()

    asyncio.run(scenario())


def test_a_sample_with_no_usable_actor_left_fails_the_step_naming_its_tries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rollouts, "READY_TIMEOUT_SECONDS", 0.3)

    async def scenario() -> None:
        failing = [await FakeActor("fail").start() for _ in range(2)]
        discovery = FixedActors([a.url for a in failing])
        with pytest.raises(RolloutError, match=r"no actor was usable for 0.3s; this sample's tries: http://.*500"):
            await collect_rollouts(discovery, PROMPTS, GROUP, SAMPLING)
        for actor in failing:
            await actor.stop()

    asyncio.run(scenario())


def test_endpoint_slices_give_each_address_on_the_named_port_with_its_readiness() -> None:
    slices = [
        {
            "ports": [{"name": "metrics", "port": 9000}, {"name": "http", "port": 8000}],
            "endpoints": [
                {"addresses": ["10.0.0.1"], "conditions": {"ready": True}},
                {"addresses": ["10.0.0.2"], "conditions": {"ready": False}},
                {"addresses": ["10.0.0.3"], "conditions": {}},
                {"addresses": ["fd00::4"]},
            ],
        },
        {"ports": [{"name": "other", "port": 1}], "endpoints": [{"addresses": ["10.0.0.9"]}]},
        {"ports": None, "endpoints": None},
    ]
    assert actor_endpoints(slices) == {
        "http://10.0.0.1:8000": True,
        "http://10.0.0.2:8000": False,
        "http://10.0.0.3:8000": True,
        "http://[fd00::4]:8000": True,
    }


ENVIRONMENT_TURN = [7, 7]
"""What the toy environment says between the policy's two turns."""


async def two_turns(row: Mapping[str, Any], prompt_token_ids: list[int], client: Client) -> Episode:
    """A toy two-turn environment: the policy answers, the environment replies, the policy answers again."""
    assert row == {"prompt_token_ids": prompt_token_ids}
    first = await client.generate(prompt_token_ids)
    second = await client.generate(prompt_token_ids + first.token_ids + ENVIRONMENT_TURN, {"max_tokens": 2})
    return Episode(
        first.token_ids + ENVIRONMENT_TURN + second.token_ids,
        first.logprobs + [0.0] * len(ENVIRONMENT_TURN) + second.logprobs,
        [True] * len(first.token_ids) + [False] * len(ENVIRONMENT_TURN) + [True] * len(second.token_ids),
    )


def test_a_two_turn_rollout_function_masks_the_environments_tokens() -> None:
    async def scenario() -> None:
        actor = await FakeActor(version=4).start()
        sampled = await collect_rollouts(FixedActors([actor.url]), PROMPTS, GROUP, SAMPLING, function=two_turns)
        assert len(sampled) == 16 and actor.served == 32, "two turns per sample"
        rollout = next(r for r in sampled if r.group == 1)
        assert rollout.prompt == [1, 20]
        assert rollout.completion == [21, 21, 21, 7, 7, 8, 8], "the second turn continues the environment's reply"
        assert rollout.policy_mask == [True, True, True, False, False, True, True]
        assert rollout.logprobs == [-1.0, -1.0, -1.0, 0.0, 0.0, -1.0, -1.0]
        assert rollout.versions == [4] * 7
        await actor.stop()

    asyncio.run(scenario())


def test_a_rollout_function_is_given_its_prompts_dataset_row() -> None:
    seen: dict[int, Mapping[str, Any]] = {}

    async def remember(row: Mapping[str, Any], prompt_token_ids: list[int], client: Client) -> Episode:
        seen[len(seen)] = row
        turn = await client.generate(prompt_token_ids)
        return Episode(turn.token_ids, turn.logprobs, [True] * len(turn.token_ids))

    async def scenario() -> None:
        actor = await FakeActor().start()
        rows = [{"question": f"q{n}", "answer": str(n)} for n in range(len(PROMPTS))]
        await collect_rollouts(FixedActors([actor.url]), PROMPTS, 1, SAMPLING, rows=rows, function=remember)
        await actor.stop()

    asyncio.run(scenario())
    assert sorted(row["answer"] for row in seen.values()) == [str(n) for n in range(len(PROMPTS))]
    for row in seen.values():
        assert row["prompt_token_ids"] == list(PROMPTS[int(row["answer"])]), "the row's own prompt"


def test_a_rollout_function_may_not_change_the_temperature_or_return_ragged_lists() -> None:
    async def hotter(row: Mapping[str, Any], prompt_token_ids: list[int], client: Client) -> Episode:
        await client.generate(prompt_token_ids, {"temperature": 2.0})
        raise AssertionError("refused before sampling")

    async def ragged(row: Mapping[str, Any], prompt_token_ids: list[int], client: Client) -> Episode:
        turn = await client.generate(prompt_token_ids)
        return Episode(turn.token_ids, turn.logprobs, [True])

    async def scenario() -> None:
        actor = await FakeActor().start()
        actors = FixedActors([actor.url])
        sampling = {**SAMPLING, "temperature": 1.0}
        with pytest.raises(RolloutError, match=r"hotter: sampling.temperature: a rollout function may not change"):
            await collect_rollouts(actors, PROMPTS, GROUP, sampling, function=hotter)
        with pytest.raises(RolloutError, match=r"ragged: .*3 token_ids, 3 logprobs and 1 policy_mask entries"):
            await collect_rollouts(actors, PROMPTS, GROUP, SAMPLING, function=ragged)
        await actor.stop()

    asyncio.run(scenario())


def test_an_moe_samples_routed_experts_travel_with_it_and_a_multi_turn_ones_are_its_last_turns() -> None:
    async def scenario() -> None:
        actor = await FakeActor(moe_layers=2).start()
        single = await collect_rollouts(FixedActors([actor.url]), PROMPTS[:1], 1, SAMPLING)
        turns = await collect_rollouts(FixedActors([actor.url]), PROMPTS[:1], 1, SAMPLING, function=two_turns)
        dense = await FakeActor().start()
        plain = await collect_rollouts(FixedActors([dense.url]), PROMPTS[:1], 1, SAMPLING)
        await actor.stop()
        await dense.stop()
        for (rollout,) in (single, turns):
            tokens = len(rollout.prompt) + len(rollout.completion) - 1  # the whole sequence but its last token
            expected = torch.tensor([[[n, n + 1]] * 2 for n in range(tokens)], dtype=torch.int16)
            assert rollout.routed_experts is not None and torch.equal(rollout.routed_experts, expected)
        assert plain[0].routed_experts is None

    asyncio.run(scenario())


def test_versions_of_a_rollout_that_reorders_its_turns_err_on_the_old_side() -> None:
    turns = [Generation([5, 6], [-1.0, -1.0], [3, 4])]
    kept = episode_rollout(Episode([5, 6], [-1.0, -1.0], [True, True]), [1], 0, turns)
    assert kept.versions == [3, 4]
    reordered = episode_rollout(Episode([6, 5], [-1.0, -1.0], [True, True]), [1], 0, turns)
    assert reordered.versions == [3, 3], "tokens that are not the turns' in order: each gets the oldest version"
    routed = [Generation([5, 6], [-1.0, -1.0], [3, 4], torch.zeros(2, 2, 2, dtype=torch.int16))]
    assert episode_rollout(Episode([5, 6], [-1.0, -1.0], [True, True]), [1], 0, routed).routed_experts is not None
    reordered = episode_rollout(Episode([6, 5], [-1.0, -1.0], [True, True]), [1], 0, routed)
    assert reordered.routed_experts is None, "another sequence than the engine's: the trainer routes it itself"
