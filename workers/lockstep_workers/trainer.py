"""The trainer: token logprobs with the lm_head in fp32, group-normalised advantages, the objective
of lockstep_workers.objective and one optimiser step (``learn``); and the loop the trainer pod runs.

``python -m lockstep_workers.trainer --model=PATH --settings=JSON`` (the RLJob's spec.trainer
training fields, rendered by the operator). Each step rank 0 samples rollouts from the actors
($LOCKSTEP_ACTORS_URL, comma-separated), scores them with the job's reward function and hands each
rank whole prompt groups; the ranks average their gradients (torch.distributed: gloo on CPU, NCCL on
GPU, from $RANK, $WORLD_SIZE, $MASTER_ADDR, $MASTER_PORT); rank 0 then publishes the weights under
$LOCKSTEP_SHARED_DIR/weights, announces them on its own pod (the operator runs the barrier), appends
the step's metrics to $LOCKSTEP_SHARED_DIR/metrics.jsonl and serves them to Prometheus. With a
collective backend ($LOCKSTEP_WEIGHT_SYNC nccl or gloo) rank 0 also serves each version's manifest and
sends the weights itself, as a member of each barrier (lockstep_workers.transfer). Rollouts of
the next step are sampled while the actors take the update in flight; each token carries the version
it was sampled under, and the mismatch is measured on the tokens of the trainer's own version.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import importlib
import json
import logging
import os
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from prometheus_client import Gauge, start_http_server

from lockstep import keys
from lockstep.api import (
    DType,
    Mismatch,
    MismatchBudget,
    Objective,
    TrainerParity,
    Training,
    Weights,
    WeightSyncBackend,
)
from lockstep.barrier import document
from lockstep_workers.objective import Batch, policy_loss
from lockstep_workers.transfer import ManifestServer, Sender, manifest_uri
from lockstep_workers.weights import newest_version, publish, tensors, verified_path, version_path

logger = logging.getLogger("lockstep.trainer")

RewardFunction = Callable[[list[int], list[int]], float]
"""reward(prompt token ids, completion token ids) -> a scalar reward."""
PromptSource = Callable[[int, int, int], list[list[int]]]
"""prompts(step, count, seed) -> ``count`` prompts as token id lists."""


def load_callable(reference: str) -> Any:
    """The callable named ``package.module:function`` (RLJob spec.trainer.reward and .prompts)."""
    module, _, name = reference.partition(":")
    if not name:
        raise ValueError(f"{reference!r}: expected 'package.module:function'")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"{reference!r} cannot be imported in the trainer's image: {error}") from error


def load_reward(reference: str) -> RewardFunction:
    function: RewardFunction = load_callable(reference)
    return function


@dataclass(frozen=True)
class Rollout:
    """One sampled completion, with the rollout engine's processed logprob of each token and the
    weights version each token was sampled under."""

    prompt: list[int]
    completion: list[int]
    logprobs: list[float]
    group: int  # completions of the same prompt share a group (GRPO/GSPO advantages)
    versions: list[int] = field(default_factory=list)


async def collect_rollouts(
    actors: Sequence[str], prompts: Sequence[list[int]], group: int, sampling: dict[str, Any]
) -> list[Rollout]:
    """``group`` completions of every prompt from the actors' /generate (spread over them), with the
    processed logprob of each sampled token as the rollout engine computed it."""
    import aiohttp

    requests = [(index, prompt) for index, prompt in enumerate(prompts) for _ in range(group)]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:

        async def one(position: int, index: int, prompt: list[int]) -> Rollout:
            url = f"{actors[position % len(actors)]}/generate"
            async with session.post(url, json={"prompt_token_ids": prompt, "sampling": sampling}) as response:
                response.raise_for_status()
                body = await response.json()
            return Rollout(list(prompt), body["token_ids"], body["logprobs"], index, body["weights_versions"])

        return list(await asyncio.gather(*(one(n, i, p) for n, (i, p) in enumerate(requests))))


def top_p_masked(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """``logits`` with the tokens outside the nucleus set to -inf, as vLLM's sampler does it: sorted by
    probability, a token goes when the tokens less likely than it, and it, hold at most 1 - top_p."""
    ordered, order = logits.sort(dim=-1)
    outside = ordered.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
    outside[..., -1] = False
    return logits.masked_fill(outside.scatter(-1, order, outside), float("-inf"))


def token_logprobs(
    model: Any,
    rollouts: Sequence[Rollout],
    temperature: float,
    *,
    top_p: float = 1.0,
    fp32_head: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logprobs of each completion token under ``model`` (a Hugging Face causal LM) after the sampler's
    transform (temperature, then top-p), their entropies and the completion mask, all [sequences,
    longest completion]. A token outside the trainer's top-p set gets -inf. The final projection runs
    in fp32 when ``fp32_head`` (the ParityPolicy's trainer.lmHeadDtype), as the rollout engine's does."""
    longest = max(len(r.prompt) + len(r.completion) for r in rollouts)
    widest = max(len(r.completion) for r in rollouts)
    ids = torch.zeros(len(rollouts), longest, dtype=torch.long)
    attention = torch.zeros_like(ids)
    for row, r in enumerate(rollouts):
        sequence = r.prompt + r.completion
        ids[row, : len(sequence)] = torch.tensor(sequence)
        attention[row, : len(sequence)] = 1
    hidden = model.model(input_ids=ids, attention_mask=attention).last_hidden_state
    head = model.lm_head.weight
    logits = F.linear(hidden.float(), head.float()) if fp32_head else model.lm_head(hidden).float()
    logits = logits / temperature
    if top_p < 1:
        logits = top_p_masked(logits, top_p)
    logprobs = torch.zeros(len(rollouts), widest)
    entropy = torch.zeros(len(rollouts), widest)
    mask = torch.zeros(len(rollouts), widest)
    for row, r in enumerate(rollouts):
        start, count = len(r.prompt) - 1, len(r.completion)
        scores = torch.log_softmax(logits[row, start : start + count], dim=-1)
        logprobs[row, :count] = scores.gather(1, torch.tensor(r.completion)[:, None])[:, 0]
        entropy[row, :count] = -(scores.exp() * scores.nan_to_num(neginf=0.0)).sum(dim=-1)
        mask[row, :count] = 1
    return logprobs, entropy, mask


def group_advantages(rewards: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """Each reward minus its group's mean, over the group's standard deviation (GRPO-style)."""
    advantages = torch.zeros_like(rewards)
    for group in groups.unique():
        members = groups == group
        values = rewards[members]
        advantages[members] = (values - values.mean()) / (values.std(unbiased=False) + 1e-6)
    return advantages


def learn(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    rollouts: Sequence[Rollout],
    rewards: Sequence[float],
    objective: Objective,
    temperature: float,
    *,
    top_p: float = 1.0,
    fp32_head: bool = True,
    version: int | None = None,
    synchronize: Callable[[torch.nn.Module], None] | None = None,
) -> dict[str, float]:
    """``objective.minibatches`` optimiser steps on a batch of rollouts (each on a slice of its prompt
    groups); the step's metrics, averaged over the minibatches.

    The ratios are taken against the model as it was when the batch arrived (``old``), so they depart
    from 1, and clipping acts, from the second minibatch on. ``version`` is the weights version the
    model holds: tokens sampled under it give the on-policy mismatch (``onpolicy_mean_abs_logprob_diff``,
    pure numerics) and the others the ``lag``. ``synchronize`` runs between backward and each optimiser
    step (the ranks' gradient all-reduce).
    """
    with torch.no_grad():
        old, _, completion = token_logprobs(model, rollouts, temperature, top_p=top_p, fp32_head=fp32_head)
    # A token vLLM sampled that falls outside the trainer's top-p set has no finite ratio: it is left out.
    mask = completion * old.isfinite()
    old = old.nan_to_num(neginf=0.0)
    rollout = torch.zeros_like(old)
    for row, r in enumerate(rollouts):
        rollout[row, : len(r.logprobs)] = torch.tensor(r.logprobs)
    reward = torch.tensor(list(rewards), dtype=torch.float32)
    groups = torch.tensor([r.group for r in rollouts])
    advantages = group_advantages(reward, groups)
    steps = []
    for chunk in torch.tensor_split(groups.unique(), objective.minibatches):
        rows = torch.isin(groups, chunk).nonzero()[:, 0]
        new, entropy, _ = token_logprobs(
            model, [rollouts[i] for i in rows], temperature, top_p=top_p, fp32_head=fp32_head
        )
        width = new.shape[1]
        part = mask[rows, :width]
        new = torch.where(part.bool(), new, 0.0)
        batch = Batch(new, old[rows, :width], rollout[rows, :width], advantages[rows], part, entropy.detach())
        loss, metrics = policy_loss(batch, objective)
        optimizer.zero_grad()
        loss.backward()
        if synchronize is not None:
            synchronize(model)
        optimizer.step()
        steps.append(metrics)
    averaged = {name: sum(m[name] for m in steps) / len(steps) for name in steps[0]}
    averaged["outside_top_p_fraction"] = ((completion - mask).sum() / completion.sum().clamp(min=1)).item()
    if version is not None:
        averaged.update(_staleness(rollouts, old, rollout, mask, version))
    return {"reward": reward.mean().item(), **averaged}


def _staleness(
    rollouts: Sequence[Rollout], old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, version: int
) -> dict[str, float]:
    """Mismatch on the tokens of sequences sampled wholly under ``version`` (numerics alone: a sequence
    that spans an in-flight update keeps KV computed under the old weights); how stale the rest was."""
    versions = torch.full_like(mask, float(version))
    for row, r in enumerate(rollouts):
        versions[row, : len(r.versions)] = torch.tensor(r.versions, dtype=versions.dtype)
    seen = versions.masked_fill(~mask.bool(), float(version))
    onpolicy = mask * (seen == version).all(dim=1, keepdim=True).float()
    spanning = (seen.amax(dim=1) != seen.amin(dim=1)).float()
    return {
        "onpolicy_mean_abs_logprob_diff": ((old - rollout).abs() * onpolicy).sum().item()
        / max(onpolicy.sum().item(), 1),
        "onpolicy_token_fraction": (onpolicy.sum() / mask.sum().clamp(min=1)).item(),
        "spanning_sequence_fraction": spanning.mean().item(),
        "lag": version - seen.min().item(),
    }


# -- the trainer pod's loop ---------------------------------------------------------------

STEP_METRICS = (
    "reward",
    "entropy",
    "clamp_log_ratio_new_old_indicator",
    "kl_new_old",
    "ess",
    "mean_abs_logprob_diff",
    "onpolicy_mean_abs_logprob_diff",
    "onpolicy_token_fraction",
    "spanning_sequence_fraction",
    "lag",
    "outside_top_p_fraction",
    "tis_weight_mean",
    "loss",
)
"""Every step's metrics, in metrics.jsonl and as Prometheus gauges ``lockstep_trainer_<name>``."""
GAUGES = {name: Gauge(f"lockstep_trainer_{name}", f"The last step's {name}.") for name in STEP_METRICS}
PUBLISHED = Gauge("lockstep_trainer_weights_version", "The newest weights version published and announced.")


@dataclass(frozen=True)
class PodEnvironment:
    """What the operator sets in a trainer pod's environment."""

    rank: int
    world_size: int
    actors: list[str]
    shared_dir: Path | None
    """The job's directory for weights and metrics (on spec.weightSync.volume, or an emptyDir)."""
    config: dict[str, Any]
    pod: str | None
    namespace: str | None
    metrics_port: int
    weight_sync: WeightSyncBackend = WeightSyncBackend.FILESYSTEM
    weights_host: str = "127.0.0.1"
    """Collective backends: the name the actors reach this pod by."""
    weights_port: int = 0
    """Collective backends: where the manifests are served."""
    weights_group_port: int = 0
    """Collective backends: the rendezvous of each barrier's transfer group."""

    @property
    def weights_dir(self) -> Path:
        assert self.shared_dir is not None
        return self.shared_dir / "weights"

    @property
    def rendezvous(self) -> str:
        return f"{self.weights_host}:{self.weights_group_port}"

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> PodEnvironment:
        config_file = environ.get("LOCKSTEP_CONFIG")
        return cls(
            rank=int(environ.get("RANK", "0")),
            world_size=int(environ.get("WORLD_SIZE", "1")),
            actors=[url.rstrip("/") for url in environ.get("LOCKSTEP_ACTORS_URL", "").split(",") if url],
            shared_dir=Path(environ["LOCKSTEP_SHARED_DIR"]) if "LOCKSTEP_SHARED_DIR" in environ else None,
            config=json.loads(Path(config_file).read_text()) if config_file else {},
            pod=environ.get("POD_NAME"),
            namespace=environ.get("POD_NAMESPACE"),
            metrics_port=int(environ.get("LOCKSTEP_METRICS_PORT", "0")),
            weight_sync=WeightSyncBackend(environ.get("LOCKSTEP_WEIGHT_SYNC", WeightSyncBackend.FILESYSTEM)),
            weights_host=environ.get("LOCKSTEP_WEIGHTS_HOST", "127.0.0.1"),
            weights_port=int(environ.get("LOCKSTEP_WEIGHTS_PORT", "0")),
            weights_group_port=int(environ.get("LOCKSTEP_WEIGHTS_GROUP_PORT", "0")),
        )


def wait_for_actors(actors: Sequence[str], timeout: float = 1800.0) -> None:
    """Block until every actor URL answers /ready (each has loaded its weights)."""
    deadline = time.monotonic() + timeout
    waiting = [url for url in actors if served_version(url) is None]
    while waiting:
        if time.monotonic() > deadline:
            raise TimeoutError(f"actors not ready after {timeout:.0f}s: {', '.join(waiting)}")
        logger.info("waiting for %d of %d actor(s) to be ready: %s", len(waiting), len(actors), waiting[0])
        time.sleep(2)
        waiting = [url for url in waiting if served_version(url) is None]


def served_version(url: str) -> int | None:
    """The weights version the actor behind ``url`` serves (any actor, through a Service), or None while it
    is not ready (/ready answers 503) or not reachable."""
    try:
        with urllib.request.urlopen(f"{url}/ready", timeout=5) as response:
            return int(json.loads(response.read())["version"])
    except (OSError, ValueError, KeyError):
        return None


def wait_for_version(url: str, version: int) -> None:
    """Block until the actors serve ``version`` or newer.

    One actor's answer speaks for all: the barrier resumes no actor before every one has loaded. A
    barrier that never ends is the operator's to fail (spec.weightSync.barrierTimeoutSeconds), which
    deletes this pod.
    """
    logged = time.monotonic()
    while (served_version(url) or 0) < version:
        if time.monotonic() - logged > 10:
            logger.info("waiting for the actors to serve weights version %d (spec.trainer.maxLag)", version)
            logged = time.monotonic()
        time.sleep(0.1)


def _average_gradients(model: torch.nn.Module) -> None:
    world = dist.get_world_size()
    for parameter in model.parameters():
        if parameter.grad is not None:
            dist.all_reduce(parameter.grad)
            parameter.grad /= world


def _across_ranks(metrics: dict[str, float]) -> dict[str, float]:
    """Every rank's metrics combined: the mean, but the largest lag."""
    names = sorted(metrics)
    values = torch.tensor([metrics[name] for name in names], dtype=torch.float64)
    largest = values.clone()
    dist.all_reduce(values)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    combined = dict(zip(names, (values / dist.get_world_size()).tolist(), strict=True))
    combined["lag"] = largest[names.index("lag")].item()
    return combined


def announce(weights: Weights, mismatch: Mismatch, namespace: str, pod: str) -> None:
    """Write ``lockstep.dev/weights`` and the step's ``lockstep.dev/mismatch`` on this trainer pod (the only
    place the operator reads them from)."""
    from lockstep_workers.agent import pod_api

    annotations = {keys.WEIGHTS: document(weights), keys.MISMATCH: document(mismatch)}
    pod_api().patch_namespaced_pod(pod, namespace, {"metadata": {"annotations": annotations}})


def resume(model: torch.nn.Module, committed: Weights | None, directory: Path) -> int:
    """Load the newest weights this job's trainer published in ``directory`` into ``model`` and return the
    first step to run: a restarted trainer goes on from them, with a fresh optimiser state, rather than from
    the base model. That is the job's committed version (``committed``, checked against its digest), or one
    announced after it whose update may still be in flight; numbering on from it keeps each version number
    naming one set of weights. With nothing published and nothing committed, step 1 from the base model."""
    newest = newest_version(directory)
    if newest is None or (committed is not None and newest < committed.version):
        if committed is None:
            return 1
        raise SystemExit(
            f"cannot resume: the committed weights version {committed.version} are not in {directory}. With "
            "spec.weightSync.backend nccl or gloo, set spec.weightSync.volume so that a restarted trainer finds "
            "its checkpoints"
        )
    path = version_path(directory, newest)
    if committed is not None and newest == committed.version:
        verified_path(committed.model_copy(update={"uri": path.resolve().as_uri()}))
    unexpected = model.load_state_dict(dict(tensors(path)), strict=False).unexpected_keys
    if unexpected:
        raise ValueError(f"the published weights {path} do not fit this model: {unexpected[:5]}")
    logger.info("resuming from weights version %d (committed: %s)", newest, committed.version if committed else "none")
    return newest + 1


def _committed(env: PodEnvironment) -> Weights | None:
    if not (env.pod and env.namespace):
        return None
    from lockstep_workers.agent import initial_weights, pod_api

    return initial_weights(pod_api(), env.namespace, env.pod)


def _from_rank0(model: torch.nn.Module, first_step: int) -> int:
    """Every rank starts from rank 0's weights and step."""
    for parameter in model.parameters():
        dist.broadcast(parameter.data, src=0)
    step = [first_step]
    dist.broadcast_object_list(step, src=0)
    return int(step[0])


def train(model_path: str, settings: Training, env: PodEnvironment) -> None:
    """The whole job, as one rank: ``settings.steps`` steps; rank 0 publishes and announces each version."""
    from transformers import AutoModelForCausalLM

    if env.shared_dir is None:
        raise SystemExit(
            "LOCKSTEP_SHARED_DIR is not set: the operator sets it to the directory for the job's weights and "
            "metrics; run the trainer as the operator renders it"
        )
    leader = env.rank == 0
    distributed = env.world_size > 1
    if distributed:
        dist.init_process_group(
            "nccl" if torch.cuda.is_available() else "gloo", rank=env.rank, world_size=env.world_size
        )
    torch.manual_seed(settings.seed)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    first_step = resume(model, _committed(env), env.weights_dir) if leader else 1
    if distributed:
        first_step = _from_rank0(model, first_step)
    optimizer = torch.optim.Adam(model.parameters(), lr=settings.objective.learning_rate)
    parity = TrainerParity.model_validate(env.config.get("trainer", {}))
    fp32_head = parity.lm_head_dtype is DType.FLOAT32
    budget = MismatchBudget.model_validate(env.config.get("mismatchBudget", {})).mean_abs_logprob_diff
    reward: RewardFunction = load_callable(settings.reward)
    prompts: PromptSource = load_callable(settings.prompts)
    rollout = settings.rollout
    sampling = {"temperature": rollout.temperature, "top_p": rollout.top_p, "max_tokens": rollout.max_tokens}
    metrics_file = env.shared_dir / "metrics.jsonl"
    sending: Sending | None = None
    if leader:
        if not env.actors:
            raise SystemExit("LOCKSTEP_ACTORS_URL is empty: the trainer has no actors to sample from")
        if env.metrics_port:
            start_http_server(env.metrics_port)
        if env.weight_sync.collective:
            sending = Sending(env)
        wait_for_actors(env.actors)
    for step in range(first_step, settings.steps + 1):
        started = time.monotonic()
        batch: list[Any] = [None]
        if leader:
            wait_for_version(env.actors[0], step - 1 - settings.max_lag)
            sampled = asyncio.run(
                collect_rollouts(
                    env.actors,
                    prompts(step, rollout.prompts_per_step, settings.seed),
                    rollout.samples_per_prompt,
                    sampling,
                )
            )
            batch = [(sampled, [reward(r.prompt, r.completion) for r in sampled])]
        if distributed:
            dist.broadcast_object_list(batch, src=0)
        everything, rewards = batch[0]
        mine = [n for n, r in enumerate(everything) if r.group % env.world_size == env.rank]
        metrics = learn(
            model,
            optimizer,
            [everything[n] for n in mine],
            [rewards[n] for n in mine],
            settings.objective,
            rollout.temperature,
            top_p=rollout.top_p,
            fp32_head=fp32_head,
            version=step - 1,
            synchronize=_average_gradients if distributed else None,
        )
        if distributed:
            metrics = _across_ranks(metrics)
        if not leader:
            continue
        metrics["reward"] = sum(rewards) / len(rewards)  # over the whole batch, not a shard
        weights = publish(model.state_dict(), env.weights_dir, version=step)
        if env.weight_sync.collective:
            weights = weights.model_copy(update={"uri": manifest_uri(env.weights_host, env.weights_port, step)})
        if env.pod and env.namespace:
            mismatch = Mismatch(
                step=step,
                mean_abs_logprob_diff=metrics["onpolicy_mean_abs_logprob_diff"],
                token_fraction=metrics["onpolicy_token_fraction"],
            )
            announce(weights, mismatch, env.namespace, env.pod)
        record = {"step": step, "version": step, "seconds": round(time.monotonic() - started, 3), **metrics}
        with metrics_file.open("a") as stream:
            stream.write(json.dumps(record) + "\n")
        for name, gauge in GAUGES.items():
            gauge.set(metrics[name])
        PUBLISHED.set(step)
        if metrics["onpolicy_mean_abs_logprob_diff"] > budget:
            logger.warning(
                "step %d: mean |logprob difference| %.2e on on-policy tokens exceeds the ParityPolicy budget %.2e",
                step,
                metrics["onpolicy_mean_abs_logprob_diff"],
                budget,
            )
        logger.info(
            "step %d/%d: reward %.3f, clip rate %.3f, KL %.2e, ESS %.3f, lag %d, %.1fs; announced weights version %d",
            step,
            settings.steps,
            metrics["reward"],
            metrics["clamp_log_ratio_new_old_indicator"],
            metrics["kl_new_old"],
            metrics["ess"],
            metrics["lag"],
            record["seconds"],
            step,
        )
    if sending is not None:
        logger.info("waiting for the actors to receive the final weights version %d from this pod", settings.steps)
        wait_for_version(env.actors[0], settings.steps)
        sending.close()
    if distributed:
        dist.destroy_process_group()


class Sending:
    """Collective backends, rank 0: serve the manifests, and send each version as a member of its barrier
    (an agent thread acts on the commands the operator writes on this pod) until ``close``."""

    AGENT_WATCH_SECONDS = 5
    """How long the agent's watch runs before it checks whether to stop (so ``close`` returns soon)."""

    def __init__(self, env: PodEnvironment) -> None:
        from lockstep_workers.agent import AgentCore, PodAgent, pod_api

        self.server = ManifestServer(env.weights_dir, env.weights_port, env.rendezvous)
        self.stop = threading.Event()
        self.agent: threading.Thread | None = None
        if env.pod and env.namespace:
            sender = AgentCore(Sender(env.weights_dir, env.rendezvous, env.weight_sync))
            agent = PodAgent(sender, pod_api(), env.namespace, env.pod)
            self.agent = threading.Thread(
                target=agent.run, args=(self.stop, self.AGENT_WATCH_SECONDS), name="barrier-agent", daemon=True
            )
            self.agent.start()

    def close(self) -> None:
        """Stop the agent between two API calls (never in the middle of one) and the manifest server."""
        self.stop.set()
        if self.agent is not None:
            self.agent.join(timeout=3 * self.AGENT_WATCH_SECONDS)
        self.server.close()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m lockstep_workers.trainer", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="path of the base model")
    parser.add_argument("--settings", required=True, help="the RLJob's training settings, as JSON")
    options = parser.parse_args()
    faulthandler.enable()  # a crash in native code (torch, gloo, NCCL) leaves its stack in the pod log
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    train(options.model, Training.model_validate_json(options.settings), PodEnvironment.from_environ(os.environ))


if __name__ == "__main__":
    main()
