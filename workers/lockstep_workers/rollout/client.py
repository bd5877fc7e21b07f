"""The rollout client: trainer rank 0's side of the actors (their /generate and /ready endpoints).

Where the actors are (``Discovery``): in a pod, the endpoints of the job's actor Service as its EndpointSlices
list them ($LOCKSTEP_ACTORS_SERVICE, watched as the pod's service account), so that the client picks each actor
itself instead of going through one ClusterIP that kube-proxy balances per connection; elsewhere the fixed URLs
in $LOCKSTEP_ACTORS_URL.

How a step samples (``collect_rollouts``):
- each request goes to the usable actor with the fewest requests outstanding;
- a request that fails (no connection, an answer other than 200 or 400, no answer within the request timeout)
  takes its actor out of the pool, and is sent again to another actor: a new sample. After ``MAX_ATTEMPTS``
  tries it fails the step;
- an actor out of the pool comes back once its /ready answers 200 (asked every ``PROBE_SECONDS``) while
  discovery lists it ready; an actor its EndpointSlice lists not ready is not used;
- a 400 is the request's own fault (the actor names the field): it fails the step at once, unretried.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import aiohttp
import torch

from lockstep import environment
from lockstep_workers.actor.server import BUSY_SECONDS_METRIC
from lockstep_workers.episodes import EpisodeClient, Generation, RolloutFunction, episode_rollout, single_turn
from lockstep_workers.rollout.record import Rollout

logger = logging.getLogger("lockstep.trainer")

READY_TIMEOUT_SECONDS = 1800.0
"""How long the trainer waits for every actor to load its weights at start, and a request for a usable actor."""
READY_POLL_SECONDS = 2.0
"""How often it asks the actors that are not yet ready."""
VERSION_POLL_SECONDS = 0.1
"""How often it asks which version the actors serve, while a step waits for them (spec.trainer.maxLag)."""
WAITING_LOG_SECONDS = 10.0
"""How often a step that waits for the actors says so in the log."""
REQUEST_TIMEOUT_SECONDS = 600.0
"""The longest one /generate request may take (it may wait out a weight update) before it is sent elsewhere."""
PROBE_TIMEOUT_SECONDS = 5.0
"""The longest one /ready request may take."""
PROBE_SECONDS = 2.0
"""How often, while a step samples, the client asks the actors out of the pool whether they are ready again."""
MAX_ATTEMPTS = 4
"""How many actors one sample is tried on before it fails the step."""
STALE_RESAMPLINGS = 3
"""How many times a prompt group dropped as too stale is sampled again before the trainer gives up."""
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
"""The label the EndpointSlice controller puts on a Service's slices."""


Rows = Sequence[Mapping[str, Any]] | None
"""Each prompt's dataset row (None: prompts from a prompt source, which have none)."""


class RolloutError(RuntimeError):
    """A step could not get its rollouts: the message says which request, where, and why."""


class Actors(Protocol):
    """What the trainer asks of the actors."""

    def wait_until_ready(self) -> None:
        """Return once every actor serves (has loaded its weights)."""

    def wait_for_version(self, version: int) -> None:
        """Return once the actors serve ``version`` or newer."""

    async def served_version(self) -> int:
        """The oldest weights version the actors serve now (-1 while none answers)."""

    async def generate(
        self, prompts: Sequence[list[int]], group: int, sampling: dict[str, Any], rows: Rows = None
    ) -> list[Rollout]:
        """``group`` completions of every prompt, with their processed logprobs and versions (``rows``: each
        prompt's dataset row, for the rollout function)."""

    async def busy_seconds(self) -> dict[str, float]:
        """Each actor's busy seconds so far, as its own /metrics counts them (``BUSY_SECONDS_METRIC``); the
        actors that do not answer are left out."""


class Discovery(Protocol):
    """Where the actors are."""

    def endpoints(self) -> Mapping[str, bool]:
        """Every actor's base URL, and whether it is listed ready."""


@dataclass(frozen=True)
class FixedActors:
    """Actors at fixed URLs ($LOCKSTEP_ACTORS_URL), always listed ready: only their failures take them out."""

    urls: Sequence[str]

    def endpoints(self) -> Mapping[str, bool]:
        return dict.fromkeys(self.urls, True)


def actor_endpoints(
    slices: Iterable[Mapping[str, Any]], port_name: str = environment.ACTOR_PORT_NAME
) -> dict[str, bool]:
    """URL -> listed ready, for every endpoint address of ``slices`` (EndpointSlices as the API serves them) on
    their port named ``port_name``. An unset ready condition means ready, as the API defines it."""
    urls: dict[str, bool] = {}
    for piece in slices:
        port = next((p.get("port") for p in piece.get("ports") or [] if p.get("name") == port_name), None)
        if port is None:
            continue
        for endpoint in piece.get("endpoints") or []:
            ready = (endpoint.get("conditions") or {}).get("ready") is not False
            for address in endpoint.get("addresses") or []:
                host = f"[{address}]" if ":" in address else address
                urls[f"http://{host}:{port}"] = ready
    return urls


class EndpointSlices:
    """The actors as the EndpointSlices of ``service`` list them, kept current by a watch in a daemon thread (as
    the pod's service account, which may list and watch EndpointSlices in its namespace)."""

    RETRY_SECONDS = 2.0
    """How long the watch waits before it lists again after an error."""

    def __init__(self, namespace: str, service: str, api: Any = None) -> None:
        """``api``: a kubernetes ApiClient; by default the pod's own (in a cluster), or as $KUBECONFIG says."""
        self.namespace = namespace
        self.api = api
        self.selector = f"{SERVICE_NAME_LABEL}={service}"
        self.slices: dict[str, dict[str, Any]] = {}
        """slice name -> the slice; replaced whole on every change, so that readers need no lock"""
        self._stopped = threading.Event()
        threading.Thread(target=self._watch, name="actor-endpoints", daemon=True).start()

    def stop(self) -> None:
        """End the watch, quietly, at its next event or error (a trainer's process ends it by exiting)."""
        self._stopped.set()

    def endpoints(self) -> Mapping[str, bool]:
        return actor_endpoints(self.slices.values())

    def _watch(self) -> None:
        from kubernetes import client, config, watch

        if self.api is None:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
        api = client.DiscoveryV1Api(self.api)
        while not self._stopped.is_set():
            try:
                response: Any = api.list_namespaced_endpoint_slice(
                    self.namespace, label_selector=self.selector, _preload_content=False
                )
                listed = json.loads(response.data)
                self.slices = {item["metadata"]["name"]: item for item in listed["items"]}
                for event in watch.Watch().stream(
                    api.list_namespaced_endpoint_slice,
                    self.namespace,
                    label_selector=self.selector,
                    resource_version=listed["metadata"]["resourceVersion"],
                    timeout_seconds=300,
                ):
                    if self._stopped.is_set():
                        return
                    piece: dict[str, Any] = event["raw_object"]
                    name = piece["metadata"]["name"]
                    slices = {key: value for key, value in self.slices.items() if key != name}
                    if event["type"] != "DELETED":
                        slices[name] = piece
                    self.slices = slices
            except Exception as error:  # the watch outlives every API error; the log names it
                if self._stopped.is_set():
                    return
                logger.warning("watching the actors' EndpointSlices (%s): %s; listing again", self.selector, error)
                self._stopped.wait(self.RETRY_SECONDS)


def describe(function: Any) -> str:
    """``module:name`` of a function, as spec.trainer.rollout.function names it."""
    return f"{getattr(function, '__module__', '?')}:{getattr(function, '__qualname__', function)}"


def discovery(actors_service: str | None, namespace: str | None, actor_urls: Sequence[str]) -> Discovery:
    """The job's EndpointSlices when the operator named its actor Service, else the fixed URLs."""
    if actors_service and namespace:
        return EndpointSlices(namespace, actors_service)
    if actor_urls:
        return FixedActors(actor_urls)
    raise SystemExit(
        f"neither {environment.ACTORS_SERVICE} (with {environment.POD_NAMESPACE}) nor {environment.ACTORS_URL} is "
        "set: the trainer has no actors to sample from; run it as the operator renders it, or list actor URLs"
    )


@dataclass
class ActorPool:
    """The actors a request may go to, and how many requests each has outstanding.

    ``listed``: the actors discovery lists ready; ``failed``: actors a request failed on, out of the pool until
    their /ready answers again."""

    listed: frozenset[str] = frozenset()
    failed: set[str] = field(default_factory=set)
    outstanding: Counter[str] = field(default_factory=Counter)

    def usable(self) -> list[str]:
        return sorted(self.listed - self.failed)

    def choose(self, tried: Collection[str] = ()) -> str | None:
        """The usable actor with the fewest requests outstanding, one not ``tried`` yet if there is one."""
        usable = self.usable()
        untried = [url for url in usable if url not in tried] or usable
        return min(untried, key=lambda url: self.outstanding[url], default=None)


async def ready_version(session: aiohttp.ClientSession, url: str) -> int | None:
    """The weights version the actor at ``url`` serves, or None while it is not ready (/ready answers 503) or
    not reachable."""
    try:
        timeout = aiohttp.ClientTimeout(total=PROBE_TIMEOUT_SECONDS)
        async with session.get(f"{url}/ready", timeout=timeout) as response:
            if response.status != 200:
                return None
            return int((await response.json())["version"])
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError):
        return None


T = TypeVar("T")


def _run(work: Callable[[aiohttp.ClientSession], Awaitable[T]]) -> T:
    """``work`` with a fresh HTTP session, on a fresh event loop."""

    async def session() -> T:
        async with aiohttp.ClientSession() as opened:
            return await work(opened)

    return asyncio.run(session())


class ActorService:
    """The actors ``discovery`` finds, used as the module docstring says."""

    def __init__(
        self,
        discovery: Discovery,
        request_timeout: float = REQUEST_TIMEOUT_SECONDS,
        function: RolloutFunction = single_turn,
    ) -> None:
        """``function``: how each sample is taken (spec.trainer.rollout.function)."""
        self.discovery = discovery
        self.request_timeout = request_timeout
        self.function = function
        self.pool = ActorPool()

    def wait_until_ready(self) -> None:
        """Return once discovery lists an actor and every actor it lists (ready or not) answers /ready."""

        async def wait(session: aiohttp.ClientSession) -> None:
            deadline = time.monotonic() + READY_TIMEOUT_SECONDS
            while True:
                known = sorted(self.discovery.endpoints())
                versions = await asyncio.gather(*(ready_version(session, url) for url in known))
                waiting = [url for url, version in zip(known, versions, strict=True) if version is None]
                if known and not waiting:
                    return
                if time.monotonic() > deadline:
                    missing = waiting or "none listed"
                    raise TimeoutError(f"actors not ready after {READY_TIMEOUT_SECONDS:.0f}s: {missing}")
                logger.info("waiting for %d of %d actor(s) to be ready", len(waiting), len(known))
                await asyncio.sleep(READY_POLL_SECONDS)

        _run(wait)

    def wait_for_version(self, version: int) -> None:
        """The oldest version among the listed actors that answer counts: in a rolling update
        (spec.weightSync.mode Rolling) each actor resumes on its own. A barrier that never ends is the operator's
        to fail (spec.weightSync.barrierTimeoutSeconds), which deletes this pod."""

        async def wait(session: aiohttp.ClientSession) -> None:
            logged = time.monotonic()
            while await self._served(session) < version:
                if time.monotonic() - logged > WAITING_LOG_SECONDS:
                    logger.info("waiting for the actors to serve weights version %d (spec.trainer.maxLag)", version)
                    logged = time.monotonic()
                await asyncio.sleep(VERSION_POLL_SECONDS)

        _run(wait)

    async def _served(self, session: aiohttp.ClientSession) -> int:
        urls = sorted(u for u, ready in self.discovery.endpoints().items() if ready)
        answers = [a for a in await asyncio.gather(*(ready_version(session, u) for u in urls)) if a is not None]
        return min(answers, default=-1)

    async def served_version(self) -> int:
        async with aiohttp.ClientSession() as session:
            return await self._served(session)

    async def generate(
        self, prompts: Sequence[list[int]], group: int, sampling: dict[str, Any], rows: Rows = None
    ) -> list[Rollout]:
        return await collect_rollouts(
            self.discovery,
            prompts,
            group,
            sampling,
            rows=rows,
            pool=self.pool,
            request_timeout=self.request_timeout,
            function=self.function,
        )

    def sample(
        self, prompts: Sequence[list[int]], group: int, sampling: dict[str, Any], rows: Rows = None
    ) -> list[Rollout]:
        """``generate``, on a fresh event loop."""
        return asyncio.run(self.generate(prompts, group, sampling, rows))

    async def busy_seconds(self) -> dict[str, float]:
        async with aiohttp.ClientSession() as session:
            urls = sorted(u for u, ready in self.discovery.endpoints().items() if ready)
            answers = await asyncio.gather(*(busy_seconds(session, u) for u in urls))
        return {url: seconds for url, seconds in zip(urls, answers, strict=True) if seconds is not None}


async def busy_seconds(session: aiohttp.ClientSession, url: str) -> float | None:
    """The busy seconds the actor at ``url`` counts on its /metrics, or None when it does not answer them."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        timeout = aiohttp.ClientTimeout(total=PROBE_TIMEOUT_SECONDS)
        async with session.get(f"{url}/metrics", timeout=timeout) as response:
            if response.status != 200:
                return None
            text = await response.text()
    except (aiohttp.ClientError, TimeoutError):
        return None
    for family in text_string_to_metric_families(text):
        if family.name == BUSY_SECONDS_METRIC:
            return sum(sample.value for sample in family.samples if sample.name.endswith("_total"))
    return None


async def collect_rollouts(
    discovery: Discovery,
    prompts: Sequence[list[int]],
    group: int,
    sampling: dict[str, Any],
    *,
    rows: Rows = None,
    pool: ActorPool | None = None,
    request_timeout: float = REQUEST_TIMEOUT_SECONDS,
    function: RolloutFunction = single_turn,
) -> list[Rollout]:
    """``group`` samples of every prompt, each an episode of ``function`` (lockstep_workers.episodes) on the actors'
    /generate, with the processed logprob of each sampled token as the rollout engine computed it; requests are
    spread, retried and the pool kept as the module docstring says (``pool`` carries which actors failed from one
    step to the next)."""
    pool = pool if pool is not None else ActorPool()

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=request_timeout)) as session:

        async def refresh_pool() -> None:
            pool.listed = frozenset(url for url, ready in discovery.endpoints().items() if ready)
            for url in sorted(pool.failed & pool.listed):
                if await ready_version(session, url) is not None:
                    pool.failed.discard(url)
                    logger.info("actor %s is ready again: back in the pool", url)

        async def keep_pool_current() -> None:
            while True:
                await asyncio.sleep(PROBE_SECONDS)
                await refresh_pool()

        async def usable_actor(tried: Collection[str], errors: list[str]) -> str:
            deadline = time.monotonic() + READY_TIMEOUT_SECONDS
            while (url := pool.choose(tried)) is None:
                if time.monotonic() > deadline:
                    raise RolloutError(
                        f"no actor was usable for {READY_TIMEOUT_SECONDS:g}s; this sample's tries: {'; '.join(errors)}"
                    )
                await asyncio.sleep(0.1)
            return url

        async def send(token_ids: Sequence[int], fields: Mapping[str, Any]) -> Generation:
            tried: list[str] = []
            errors: list[str] = []
            while len(tried) < MAX_ATTEMPTS:
                url = await usable_actor(tried, errors)
                tried.append(url)
                pool.outstanding[url] += 1
                try:
                    async with session.post(
                        f"{url}/generate", json={"prompt_token_ids": list(token_ids), "sampling": dict(fields)}
                    ) as response:
                        if response.status == 400:
                            raise RolloutError(f"actor {url} refused a request as malformed: {await response.text()}")
                        response.raise_for_status()
                        body = await response.json()
                    routed = body.get("routed_experts")
                    experts = None if routed is None else torch.tensor(routed, dtype=torch.int16)
                    return Generation(body["token_ids"], body["logprobs"], body["weights_versions"], experts)
                except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError) as error:
                    reason = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
                    errors.append(f"{url}: {reason}")
                    if url not in pool.failed:
                        pool.failed.add(url)
                        logger.warning("actor %s failed a request (%s): out of the pool until ready again", url, reason)
                finally:
                    pool.outstanding[url] -= 1
            raise RolloutError(f"a sample failed on {MAX_ATTEMPTS} tries: {'; '.join(errors)}")

        async def one(index: int, prompt: list[int]) -> Rollout:
            client = EpisodeClient(send, sampling)
            try:
                row = {**(rows[index] if rows else {}), "prompt_token_ids": list(prompt)}
                episode = await function(row, list(prompt), client)
                return episode_rollout(episode, prompt, index, client.turns)
            except ValueError as error:
                raise RolloutError(f"spec.trainer.rollout.function {describe(function)}: {error}") from None

        await refresh_pool()
        keeper = asyncio.create_task(keep_pool_current())
        try:
            async with asyncio.TaskGroup() as requests:  # one that fails the step cancels the others
                sampled = [requests.create_task(one(i, p)) for i, p in enumerate(prompts) for _ in range(group)]
        except ExceptionGroup as failed:
            raise failed.exceptions[0] from None
        finally:
            keeper.cancel()
        return [task.result() for task in sampled]
