"""The rollout actor: vLLM V1's AsyncLLM in this process, a small HTTP API for rollouts, and the
barrier agent that pauses, reloads and resumes it.

``python -m lockstep_workers.actor --model=PATH --port=8000 [vLLM flags]``, as lockstep.podconfig.actor_args renders
it; the weight-update semantics come from the job's PodConfig ($LOCKSTEP_CONFIG).

The vLLM settings are mapped onto the installed vLLM first (lockstep_workers.actor.vllm_args): a setting it cannot
honour stops the actor (exit 1, naming the setting and why) before vLLM starts.

HTTP: ``POST /generate`` ({"prompt_token_ids": [...], "sampling": {...}} → token ids, their
processed logprobs, the weights version each token was sampled under and, with routing replay on a mixture of
experts, the experts vLLM routed each token to: ``routed_experts``, else null), ``GET /ready`` (200 once
the newest weights are loaded; the body has the version served, the history of weight updates
with their times, the engine arguments applied and the settings satisfied by construction),
``GET /metrics`` (Prometheus; ``lockstep_actor_busy_seconds_total``, the seconds with a request in progress, gives
the trainer the actors' busy fraction). A request the actor cannot serve as sent is answered 400 with
``{"error": "<field>: what is wrong"}``. Nothing else: vLLM's dev-mode
endpoints (/collective_rpc and friends) do not exist here; weights are reloaded only through the
barrier agent, which acts on commands the operator writes on this pod, and only from the job's own weights
(``weights_origin``).

Weights arrive as files on the shared volume, or (spec.weightSync.backend nccl or gloo, in
$LOCKSTEP_WEIGHT_SYNC) sent by the trainer into vLLM's weight-transfer engine (lockstep_workers.weights.transfer).
With those, a new actor cannot fetch the job's committed weights by itself: it reports ready only once a
barrier has brought it to them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator, Coroutine, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, generate_latest

from lockstep import environment
from lockstep.api import PauseMode, VllmSettings, WeightSyncBackend, WeightUpdateSemantics
from lockstep.podconfig import ActorArgs, PodConfig, load_pod_config, parse_actor_args
from lockstep.protocol import TransferGroup, Weights
from lockstep_workers.actor.adapters import AdapterFiles, AdapterTable, LoraEngine, adapter_id, base_adapter
from lockstep_workers.actor.architectures import (
    UnsupportedArchitecture,
    check_architecture,
    moe_engine_args,
    vllm_has_triton,
)
from lockstep_workers.actor.group import node_of, placement
from lockstep_workers.actor.vllm_args import AppliedSettings, UnsupportedSetting, installed_vllm, map_settings
from lockstep_workers.weights.files import (
    NonFiniteWeights,
    VerifiedWeights,
    WeightsDirectory,
    WeightsOrigin,
    non_finite_tensors,
    weights_directory,
)
from lockstep_workers.weights.transfer import VLLM_ENGINE, StagedTransfer, TrainerManifests, receive

if TYPE_CHECKING:
    from lockstep_workers.agent.core import Staged

logger = logging.getLogger("lockstep.actor")

TOKENS = Counter("lockstep_actor_generated_tokens_total", "Tokens this actor sampled.")
WEIGHTS_VERSION = Gauge("lockstep_actor_weights_version", "The weights version this actor serves.")
PAUSED = Gauge("lockstep_actor_paused", "1 while a weight update holds generation.")
UPDATES = Counter("lockstep_actor_weight_updates_total", "Weight versions this actor loaded.")
BUSY_SECONDS_METRIC = "lockstep_actor_busy_seconds"
BUSY_SECONDS = Counter(
    BUSY_SECONDS_METRIC, "Seconds this actor had at least one /generate request in progress (its busy time)."
)


class BusyClock:
    """Counts the seconds during which at least one request is in progress into ``BUSY_SECONDS``."""

    def __init__(self) -> None:
        self.in_progress = 0
        self.since = 0.0

    def start(self) -> None:
        if self.in_progress == 0:
            self.since = time.monotonic()
        self.in_progress += 1

    def stop(self) -> None:
        self.in_progress -= 1
        if self.in_progress == 0:
            BUSY_SECONDS.inc(time.monotonic() - self.since)


BASE_VERSION = 0
"""The version of the base model the actor starts from, before any published weights."""


def applied_settings(settings: VllmSettings) -> AppliedSettings:
    """``settings`` mapped onto the installed vLLM (raises UnsupportedSetting)."""
    return map_settings(settings, installed_vllm())


def engine_args(
    model: str,
    applied: AppliedSettings,
    backend: WeightSyncBackend = WeightSyncBackend.FILESYSTEM,
    lora: LoraEngine | None = None,
    placement: dict[str, Any] | None = None,
) -> Any:
    """vLLM's AsyncEngineArgs for the applied settings, with the weight-reload extension, for a collective backend
    vLLM's weight-transfer engine, for a LoRA job vLLM's LoRA adapters, and for a pod of an actor group its
    ``placement`` (lockstep_workers.actor.group)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    kwargs: dict[str, Any] = dict(applied.engine_args) | (placement or {})
    if backend.collective:
        kwargs["weight_transfer_config"] = {"backend": VLLM_ENGINE[backend]}
    if lora is not None:
        kwargs.update(lora.engine_args())
    return AsyncEngineArgs(
        model=model, worker_extension_cls="lockstep_workers.actor.vllm_extension.WeightReloader", **kwargs
    )


class BadRequest(ValueError):
    """A request the actor cannot serve as sent; the message names the field."""


class Actor:
    """One AsyncLLM and the weights version it serves.

    ``loaded`` is the version in the engine; ``serving`` the one new tokens are sampled under. They
    differ only while an update is in progress: tokens that arrive while paused were sampled before the pause,
    under the old weights, so ``serving`` moves to the loaded version on resume. ``updates`` records, per loaded
    version, when the actor paused, loaded and resumed (wall-clock seconds), and how long its own pause, load and
    resume took (the rest of a barrier is coordination).

    With ``lora`` (a LoRA job) each version is a vLLM adapter, loaded beside the others while the engine
    generates: nothing pauses. A request is served under the adapter that was ``serving`` when it started, for its
    whole life (each of its tokens carries that version); ``resume`` points new requests at the loaded version, and
    an adapter more than maxLag versions behind goes once its requests have finished (lockstep_workers.actor.adapters).
    """

    def __init__(
        self,
        llm: Any,
        *,
        pause_mode: PauseMode = PauseMode.KEEP,
        clear_cache: bool = False,
        backend: WeightSyncBackend = WeightSyncBackend.FILESYSTEM,
        lora: LoraEngine | None = None,
    ) -> None:
        self.llm = llm
        self.pause_mode = pause_mode
        self.clear_cache = clear_cache
        self.backend = backend
        self.loaded = BASE_VERSION
        self.serving = BASE_VERSION
        self.updating = False
        """Between an update's pause (a no-op for LoRA) and its resume."""
        self.lora = lora
        self.adapters = AdapterTable(lora.max_lag) if lora is not None else None
        self.adapter_files = AdapterFiles() if lora is not None else None
        self._base_lock = asyncio.Lock()
        self.paused_at: float | None = None
        self.pause_seconds = 0.0
        self.updates: list[dict[str, float | int | None]] = []
        WEIGHTS_VERSION.set(BASE_VERSION)

    async def generate(self, prompt_token_ids: list[int], sampling: dict[str, Any]) -> dict[str, Any]:
        """Sample a completion; each token carries the weights version it was sampled under, and the request the
        experts vLLM routed its tokens to (``routed_experts``; None unless the engine returns them). Raises
        BadRequest when vLLM refuses ``sampling``."""
        from vllm import SamplingParams
        from vllm.exceptions import VLLMClientError
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        try:
            params = SamplingParams(**sampling, logprobs=0, output_kind=RequestOutputKind.DELTA)
        except (TypeError, ValueError, VLLMClientError) as error:
            raise BadRequest(f"sampling: {error} (vLLM SamplingParams fields; logprobs is set by the actor)") from None
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        routed: list[Any] | None = None
        prompt = TokensPrompt(prompt_token_ids=prompt_token_ids)
        try:
            async with self.request_adapter() as (adapter, lora_request):
                async for output in self.llm.generate(
                    prompt, params, request_id=uuid.uuid4().hex, lora_request=lora_request
                ):
                    completion = output.outputs[0]
                    for token, candidates in zip(completion.token_ids, completion.logprobs or [], strict=True):
                        tokens.append(token)
                        logprobs.append(candidates[token].logprob)
                        versions.append(self.serving if adapter is None else adapter)
                    if (experts := routed_experts(completion)) is not None:
                        routed = experts
        except VLLMClientError as error:  # vLLM's own verdict: the request, not the engine, is at fault
            raise BadRequest(f"prompt_token_ids or sampling: {error}") from None
        TOKENS.inc(len(tokens))
        return {"token_ids": tokens, "logprobs": logprobs, "weights_versions": versions, "routed_experts": routed}

    @contextlib.asynccontextmanager
    async def request_adapter(self) -> AsyncIterator[tuple[int | None, Any]]:
        """For one request, while it runs: the adapter version it is served under and vLLM's LoRARequest of it (a
        LoRA job), or (None, None) (full weights). Its adapter stays loaded until the request ends, however it ends."""
        if self.adapters is None:
            yield None, None
            return
        await self._load_base_adapter()
        version = self.adapters.start()
        try:
            yield version, _lora_request(version, self.adapter_files)
        finally:
            await self._remove_adapters(self.adapters.finish(version))

    async def pause(self) -> None:
        """Hold generation for the swap (pause_generation); for LoRA only mark the update begun: nothing pauses."""
        self.updating = True
        if self.adapters is not None:
            return
        started = time.time()
        await self.llm.pause_generation(mode=self.pause_mode.value, clear_cache=self.clear_cache)
        self.paused_at = time.time()
        self.pause_seconds = self.paused_at - started
        PAUSED.set(1)

    async def load(self, weights: Weights, source: StagedTransfer | VerifiedWeights) -> None:
        """Reload the weights in place in every vLLM worker: received from the trainer in a transfer group, or
        from the verified copy of their file (WeightsDirectory.read), which the workers read from this process's
        memory."""
        started = time.time()
        if isinstance(source, StagedTransfer):
            await receive(self.llm, source, self.backend)
        elif self.adapters is not None and self.adapter_files is not None:
            await self._add_adapter(weights.version, source.path)
        else:  # every worker checks that it computes with the file's tensors (lockstep_workers.actor.load_check)
            reports = await self.llm.collective_rpc("lockstep_reload", args=(source.path,))
            logger.info("weights version %d loaded and checked in every vLLM worker: %s", weights.version, reports)
        self.loaded = weights.version
        loaded_at = time.time()
        self.updates.append(
            {
                "version": weights.version,
                "pausedAt": self.paused_at,
                "loadedAt": loaded_at,
                "stageSeconds": source.seconds,
                "pauseSeconds": self.pause_seconds if self.paused_at is not None else 0.0,
                "loadSeconds": loaded_at - started,
            }
        )
        if not self.updating:  # initial weights, loaded before serving
            await self._serve(weights.version)
        UPDATES.inc()
        WEIGHTS_VERSION.set(weights.version)

    async def resume(self) -> None:
        """Continue under the loaded version (resume_generation); for LoRA send new requests to its adapter."""
        started = time.time()
        if self.adapters is None:
            await self.llm.resume_generation()
        await self._serve(self.loaded)
        if self.updates:
            resumed_at = time.time()
            self.updates[-1].update(resumedAt=resumed_at, resumeSeconds=resumed_at - started)
            logger.info("weight update done: %s", json.dumps(self.updates[-1]))
        self.paused_at = None
        self.updating = False
        PAUSED.set(0)

    async def _serve(self, version: int) -> None:
        self.serving = version
        if self.adapters is not None:
            await self._remove_adapters(self.adapters.serve(version))

    async def _add_adapter(self, version: int, verified: str) -> None:
        """Load version ``version``'s adapter from the verified copy of its file, generation going on; an adapter
        with a NaN or infinite value is refused."""
        assert self.adapter_files is not None
        await asyncio.to_thread(refuse_non_finite, verified, version)
        await self._load_base_adapter()
        await self._register(version, self.adapter_files.write(version, verified))

    async def _load_base_adapter(self) -> None:
        """Load version 0, the base model as an adapter of zeros (lockstep_workers.actor.adapters), before any request
        or other version; built in a thread, once."""
        assert self.adapters is not None and self.adapter_files is not None and self.lora is not None
        async with self._base_lock:
            if BASE_VERSION in self.adapters.loaded or self.loaded != BASE_VERSION:
                return
            tensors, config = await asyncio.to_thread(base_adapter, self.lora.settings, self.llm.model_config.hf_config)
            await self._register(BASE_VERSION, self.adapter_files.write_tensors(BASE_VERSION, tensors, config))
            self.adapters.serve(BASE_VERSION)

    async def _register(self, version: int, path: Path) -> None:
        """Add the adapter at ``path`` to vLLM as ``version``; a failed add leaves nothing registered (vLLM may
        list an adapter it failed to activate, and would report a retry of the same id as already loaded)."""
        assert self.adapters is not None and self.adapter_files is not None
        try:
            added, failure = await self.llm.add_lora(_lora_request(version, self.adapter_files)), ""
        except Exception as error:  # vLLM's own words on the adapter (a shape that does not fit the model)
            added, failure = False, f": {error}"
        if not added:
            with contextlib.suppress(Exception):
                await self.llm.remove_lora(adapter_id(version))
            self.adapter_files.remove(version)
            raise RuntimeError(f"vLLM did not load the adapter of weights version {version} from {path}{failure}")
        self.adapters.add(version)

    async def _remove_adapters(self, versions: list[int]) -> None:
        """Unload adapters no request uses any more, and delete their files (only then: vLLM reads them again
        when it evicts an adapter from its cache)."""
        assert self.adapters is not None and self.adapter_files is not None
        for version in versions:
            await self.llm.remove_lora(adapter_id(version))
            self.adapters.removed(version)
            self.adapter_files.remove(version)
            logger.info("unloaded the adapter of weights version %d: no request uses it", version)


def routed_experts(completion: Any) -> list[Any] | None:
    """The experts vLLM routed each token of a request to, as nested lists [tokens, layers, top_k] (its
    CompletionOutput.routed_experts, which comes with the request's last output when the engine runs with
    enable_return_routed_experts: the prompt's tokens and the completion's); None when this output has none."""
    experts = getattr(completion, "routed_experts", None)
    return None if experts is None else experts.tolist()


def refuse_non_finite(path: str, version: int) -> None:
    """Raise NonFiniteWeights, naming them, when tensors of weights version ``version`` (the verified copy at
    ``path``) hold a NaN or an infinite value; the actor keeps serving the version it has."""
    not_finite = non_finite_tensors(path)
    if not_finite:
        raise NonFiniteWeights(
            f"weights version {version}: {', '.join(not_finite[:3])} hold NaN or infinite values (a diverged step); "
            "refused, the actor keeps serving the version it has"
        )


def _lora_request(version: int | None, files: AdapterFiles | None) -> Any:
    """vLLM's LoRARequest of an adapter version (a LoRA job), or None (a full-weights job)."""
    if version is None or files is None:
        return None
    from vllm.lora.request import LoRARequest

    return LoRARequest(f"v{version}", adapter_id(version), str(files.path(version)))


def lora_engine(config: PodConfig | None) -> LoraEngine | None:
    """vLLM's LoRA settings of a LoRA job (spec.trainer.lora and maxLag, from its PodConfig), else None."""
    if config is None or config.training.lora is None:
        return None
    return LoraEngine(config.training.lora, config.training.max_lag)


def backend_of(environ: Mapping[str, str]) -> WeightSyncBackend:
    """How the job's weights reach the actors (the operator sets it in the pod's environment)."""
    return WeightSyncBackend(environ.get(environment.WEIGHT_SYNC, WeightSyncBackend.FILESYSTEM))


def weights_origin(backend: WeightSyncBackend, environ: Mapping[str, str]) -> WeightsOrigin:
    """Where this actor pod accepts weights from, as the operator sets it in the pod's environment: the job's
    weights directory (filesystem), or trainer rank 0's manifest server (nccl, gloo)."""
    needed = (environment.WEIGHTS_HOST, environment.WEIGHTS_PORT) if backend.collective else (environment.SHARED_DIR,)
    missing = [name for name in needed if not environ.get(name)]
    if missing:
        raise SystemExit(
            f"{' and '.join(missing)} not set: with weightSync.backend {backend.value} the operator sets it on "
            "actor pods, and the actor loads weights only from there; run the actor as the operator renders it"
        )
    if backend.collective:
        return TrainerManifests(environ[environment.WEIGHTS_HOST], int(environ[environment.WEIGHTS_PORT]))
    return WeightsDirectory(weights_directory(Path(environ[environment.SHARED_DIR])))


class LoopEngine:
    """The agent's Engine (called from its thread), carried out on the actor's event loop. It loads only weights
    from ``origin``: the job's initial weights and every barrier's (a refused URI raises RefusedWeights, which
    the agent acks as an error). Staging runs in the agent's thread, so the loop keeps generating meanwhile.

    A version with a tensor that is not finite is refused (NonFiniteWeights) before it is loaded: full weights as
    they are staged, before the pause (one more read of the in-memory copy); a LoRA adapter as it is added. Weights
    sent in a transfer group stream into vLLM unchecked here: the trainer sends its published file, and a publish
    refuses such a tensor (lockstep_workers.weights.files)."""

    def __init__(self, actor: Actor, loop: asyncio.AbstractEventLoop, origin: WeightsOrigin) -> None:
        self.actor = actor
        self.loop = loop
        self.origin = origin

    def _run(self, work: Coroutine[Any, Any, None]) -> None:
        asyncio.run_coroutine_threadsafe(work, self.loop).result()

    def pause(self) -> None:
        self._run(self.actor.pause())

    def stage(self, weights: Weights, group: TransferGroup | None) -> StagedTransfer | VerifiedWeights:
        self.origin.check(weights)
        if group is not None:
            return StagedTransfer.fetch(weights, group)
        verified = self.origin.read(weights)
        if self.actor.adapters is None:  # an adapter is checked as it is added (Actor.load)
            try:
                refuse_non_finite(verified.path, weights.version)
            except BaseException:
                verified.close()
                raise
        return verified

    def swap(self, staged: Staged) -> None:
        assert isinstance(staged, StagedTransfer | VerifiedWeights), staged
        self._run(self.actor.load(staged.weights, staged))

    def resume(self) -> None:
        self._run(self.actor.resume())


def application(
    actor: Actor, ready: threading.Event, applied: AppliedSettings, serving_at_least: int = BASE_VERSION
) -> web.Application:
    """The actor's HTTP API; /ready answers 200 once ``ready`` is set and the actor serves
    ``serving_at_least`` or newer, and reports the ``applied`` settings either way."""

    busy = BusyClock()

    async def generate(request: web.Request) -> web.Response:
        busy.start()
        try:
            body = await request.json()
            prompt = body.get("prompt_token_ids") if isinstance(body, dict) else None
            if not (isinstance(prompt, list) and prompt and all(type(t) is int and t >= 0 for t in prompt)):
                raise BadRequest("prompt_token_ids: expected a non-empty list of token ids (integers >= 0)")
            sampling = body.get("sampling", {})
            if not isinstance(sampling, dict):
                raise BadRequest("sampling: expected an object of vLLM SamplingParams fields")
            if sampling.get("n", 1) != 1:
                raise BadRequest("sampling.n: the actor returns one completion per request; send n requests instead")
            return web.json_response(await actor.generate(prompt, sampling))
        except json.JSONDecodeError as error:
            return web.json_response({"error": f"body: not JSON ({error})"}, status=400)
        except BadRequest as error:
            return web.json_response({"error": str(error)}, status=400)
        finally:
            busy.stop()

    async def readiness(_: web.Request) -> web.Response:
        is_ready = ready.is_set() and actor.serving >= serving_at_least
        body = {"ready": is_ready, "version": actor.serving, "updates": actor.updates, **applied.report()}
        return web.json_response(body, status=200 if is_ready else 503)

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.add_routes([web.post("/generate", generate), web.get("/ready", readiness), web.get("/metrics", metrics)])
    return app


async def serve(options: ActorArgs, applied: AppliedSettings, config: PodConfig | None) -> None:
    from vllm.v1.engine.async_llm import AsyncLLM

    update = config.weight_update if config is not None else WeightUpdateSemantics()
    backend = backend_of(os.environ)
    in_pod = bool(os.environ.get(environment.POD_NAME))
    origin = weights_origin(backend, os.environ) if in_pod else None
    lora = lora_engine(config)
    llm = AsyncLLM.from_engine_args(engine_args(options.model, applied, backend, lora, leader_placement(options)))
    actor = Actor(llm, pause_mode=update.pause_mode, clear_cache=update.clear_cache, backend=backend, lora=lora)
    logger.info(
        "vLLM is up with %s; weights arrive by %s%s",
        json.dumps(applied.report()),
        backend.value,
        f", as LoRA adapters ({json.dumps(lora.engine_args())}), loaded without pausing" if lora else "",
    )
    ready = threading.Event()
    stop = threading.Event()
    serving_at_least = BASE_VERSION
    if origin is not None:
        agent = _pod_agent(actor, asyncio.get_running_loop(), origin)
        if backend.collective:  # the committed weights come in the operator's catch-up barrier
            initial = await asyncio.to_thread(agent.initial_weights)
            serving_at_least = initial.version if initial is not None else BASE_VERSION
        else:
            await asyncio.to_thread(agent.start)  # the newest committed weights, before ready
        threading.Thread(target=agent.run, args=(stop,), name="barrier-agent", daemon=True).start()
    ready.set()
    runner = web.AppRunner(application(actor, ready, applied, serving_at_least))
    await runner.setup()
    await web.TCPSite(runner, "0.0.0.0", options.port).start()
    stopping = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):  # the kubelet's SIGTERM: shut vLLM's processes down too
        asyncio.get_running_loop().add_signal_handler(signum, stopping.set)
    try:
        await stopping.wait()
    finally:
        stop.set()
        await runner.cleanup()
        llm.shutdown()


def leader_placement(options: ActorArgs) -> dict[str, Any] | None:
    """An actor group's engine arguments for its leader, where the actor runs; None for a single-pod actor. Exits
    on a worker pod, which runs lockstep_workers.actor.headless instead."""
    if options.group is None:
        return None
    node = node_of(os.environ, options.group)
    if node.rank != 0:
        raise SystemExit(
            f"{environment.GROUP_WORKER_INDEX}={node.rank}: the actor runs on its group's leader (index 0); the "
            "group's other pods run python -m lockstep_workers.actor.headless with the same arguments"
        )
    return placement(options.group, node)


def _pod_agent(actor: Actor, loop: asyncio.AbstractEventLoop, origin: WeightsOrigin) -> Any:
    from lockstep_workers.agent.core import AgentCore
    from lockstep_workers.agent.pod_agent import PodAgent, pod_api

    engine = LoopEngine(actor, loop, origin)
    return PodAgent(
        AgentCore(engine), pod_api(), os.environ[environment.POD_NAMESPACE], os.environ[environment.POD_NAME]
    )


def with_moe_engine_args(applied: AppliedSettings, model: str, config: PodConfig | None) -> AppliedSettings:
    """``applied``, with the engine arguments the job's LoRA adapter and routing replay need on ``model``
    (lockstep_workers.actor.architectures.moe_engine_args; raises UnsupportedArchitecture where this vLLM cannot)."""
    lora = config is not None and config.training.lora is not None
    replay = config is not None and config.routing_replay
    needed = moe_engine_args(model, lora=lora, routing_replay=replay, has_triton=vllm_has_triton())
    return dataclasses.replace(applied, engine_args=applied.engine_args | needed)


def command_line() -> tuple[ActorArgs, AppliedSettings, PodConfig | None]:
    """The actor's command line (also a group's worker pods'), its settings mapped onto the installed vLLM, and the
    job's PodConfig (None outside an RLJob); exits saying why when vLLM cannot honour a setting or serve the model's
    architecture as the job asks."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    options = parse_actor_args()
    config = load_pod_config(os.environ)
    try:
        check_architecture(options.model)
        applied = with_moe_engine_args(applied_settings(options.vllm), options.model, config)
    except (UnsupportedSetting, UnsupportedArchitecture) as refused:
        raise SystemExit(f"the actor does not start: {refused}") from None
    return options, applied, config


def main() -> None:
    asyncio.run(serve(*command_line()))
