"""The trainer pod's loop: ``python -m lockstep_workers.trainer --model=PATH``, running the training settings of the
job's PodConfig ($LOCKSTEP_CONFIG: spec.trainer's training fields, rendered by the operator).

Every rank computes on its accelerator (``cuda:$LOCAL_RANK``, else the CPU) and holds a shard of the model (FSDP2,
lockstep_workers.trainer.sharding) in a torch.distributed group ($RANK, $WORLD_SIZE, $MASTER_ADDR, $MASTER_PORT: NCCL on
GPUs, gloo on CPUs). Each step rank 0 takes its prompts from the job's dataset (lockstep_workers.rollout.dataset) or
prompt source, samples rollouts from the actors (lockstep_workers.rollout.client), scores them with the job's reward
function in a process pool (lockstep_workers.rollout.scoring) and hands each rank whole prompt groups to learn from
(lockstep_workers.trainer.learner); every spec.trainer.eval.everySteps steps it first evaluates the weights the step
starts from on the eval split. Rank 0's rollout producer (lockstep_workers.rollout.producer) keeps
spec.trainer.rollout.groupsInFlight prompt groups in flight on the actors through learning, publishing and weight
updates, within spec.trainer.maxLag; each step takes its groups as soon as they are finished and scored. The full
weights, gathered from the shards, are published under $LOCKSTEP_SHARED_DIR/weights and announced on rank 0's pod (the
operator runs the barrier) in the background, while the next step runs; the step's metrics go to
$LOCKSTEP_SHARED_DIR/metrics.jsonl and to Prometheus (lockstep_workers.trainer.pod), and with spec.trainer.tracking to
TensorBoard (lockstep_workers.trainer.tracking); with spec.output rank 0 writes the model, servable
(lockstep_workers.export), at the end and every spec.output.everySteps. Every spec.trainer.checkpointEverySteps the
ranks save their shards (lockstep_workers.trainer.checkpoint). With a collective backend ($LOCKSTEP_WEIGHT_SYNC nccl or
gloo) rank 0 also serves each version's manifest and sends the weights itself, as a member of each barrier
(lockstep_workers.weights.transfer). Rollouts of the next step are sampled while the actors take the update in flight;
each token carries the version it was sampled under, and the mismatch is measured on the tokens of the trainer's own
version. With spec.trainer.lora the base model is frozen and a PEFT LoRA adapter trains (lockstep_workers.weights.lora):
each version, checkpoint and optimizer state is the adapter's alone. A mixture-of-experts model's steps record its
routing (lockstep_workers.trainer.routing); with the PodConfig's routingReplay its layers compute each sample with the
experts the actors routed it to.
"""

from __future__ import annotations

import argparse
import faulthandler
import functools
import inspect
import json
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from opentelemetry.trace import Tracer
from prometheus_client import start_http_server

from lockstep import environment, tracing
from lockstep.api import DType, MismatchBudget, Output, RolloutSettings, TrainerNumerics, Training
from lockstep.podconfig import PodConfig
from lockstep.protocol import OutputResult, Weights
from lockstep_workers import export
from lockstep_workers.episodes import RolloutFunction, single_turn
from lockstep_workers.rollout.client import Actors, ActorService, discovery
from lockstep_workers.rollout.dataset import DatasetError, Prompt, PromptDataset
from lockstep_workers.rollout.producer import Group, RolloutProducer, Schedule, StepGroups
from lockstep_workers.rollout.scoring import RewardInput, Scorer, Scores, load_callable
from lockstep_workers.trainer import checkpoint, optimization, sharding, traces
from lockstep_workers.trainer.learner import Policy, Rollout, across_ranks, lag_of, learn
from lockstep_workers.trainer.objective import ONPOLICY_MISMATCH
from lockstep_workers.trainer.pod import (
    EVAL_REWARD,
    EVAL_ROWS,
    LAG_PREFIX,
    LAG_SUFFIX,
    REWARD_PART_PREFIX,
    PodEnvironment,
    Sending,
    announce,
    committed_weights,
    record,
    record_rollouts,
    report_output,
    step_reports,
)
from lockstep_workers.trainer.shaping import masked_if_cut, overlong_metrics, penalties
from lockstep_workers.trainer.tracking import Runs, open_runs
from lockstep_workers.weights import lora
from lockstep_workers.weights.files import (
    Publisher,
    StreamedPublish,
    newest_version,
    published,
    tensors,
    verified_path,
    version_path,
)
from lockstep_workers.weights.transfer import manifest_uri

if TYPE_CHECKING:
    from peft import LoraConfig

logger = logging.getLogger("lockstep.trainer")

PromptSource = Callable[[int, int, int], list[list[int]]]
"""prompts(step, count, seed) -> ``count`` prompts as token id lists."""
GREEDY = {"temperature": 0.0, "top_p": 1.0}
"""How an evaluation samples."""


def load_rollout_function(reference: str | None) -> RolloutFunction:
    """spec.trainer.rollout.function (an async function), or the single turn when unset."""
    if reference is None:
        return single_turn
    function = load_callable(reference)
    if not inspect.iscoroutinefunction(function):
        raise ValueError(
            f"spec.trainer.rollout.function {reference!r} is not an async function: define it with 'async def "
            "function(row, prompt_token_ids, client)' (lockstep_workers.episodes)"
        )
    chosen: RolloutFunction = function
    return chosen


@dataclass(frozen=True)
class Resumption:
    """Where a (re)started trainer goes on from."""

    first_step: int
    weights: Path | None = None
    """A published version to load the model from: newer than the newest checkpoint, or there is none."""
    checkpoint: int | None = None
    """The step of the checkpoint to load the optimizer and RNG states, and unless ``weights`` the model, from."""
    announce_again: Weights | None = None
    """The version resumed from, when it is newer than the committed one: the trainer it replaces may have gone
    before the operator read its announcement, and without one no update opens, so the actors would never reach
    the version this trainer waits for (spec.trainer.maxLag). Rank 0 announces it before its first step."""


def resumption(committed: Weights | None, weights_dir: Path, checkpoints_dir: Path) -> Resumption:
    """Where to go on from: the newest weights this job's trainer published, with the newest checkpoint at or
    before them. That is the job's committed version (``committed``, checked against its digest), or one announced
    after it whose update may still be in flight; numbering on from it keeps each version number naming one set of
    weights. With nothing published and nothing committed, step 1 from the base model."""
    newest = newest_version(weights_dir)
    if newest is None or (committed is not None and newest < committed.version):
        if committed is None:
            return Resumption(1)
        raise SystemExit(
            f"cannot resume: the committed weights version {committed.version} are not in {weights_dir}. With "
            "spec.weightSync.backend nccl or gloo, set spec.weightSync.volume so that a restarted trainer finds "
            "its checkpoints"
        )
    path = version_path(weights_dir, newest)
    again = None
    if committed is not None and newest == committed.version:
        verified_path(committed.model_copy(update={"uri": path.resolve().as_uri()}))
    else:
        again = published(weights_dir, newest)
    saved = checkpoint.newest_checkpoint(checkpoints_dir, at_most=newest)
    logger.info(
        "resuming from weights version %d (committed: %s), %s",
        newest,
        committed.version if committed else "none",
        f"optimizer state from the checkpoint of step {saved}" if saved is not None else "a fresh optimizer state",
    )
    return Resumption(newest + 1, None if saved == newest else path, saved, again)


@dataclass(frozen=True)
class TrainedModel:
    """The trainer's model on this rank: the causal LM (fp32 master weights; in a LoRA job its base frozen, with the
    adapter injected), sharded as a Policy, the optimizer of the parameters that train, the adapter's PEFT
    config (None: every weight trains), and a full fine-tuning job's KL reference (None: no KL term, or a LoRA job's,
    whose reference is its base)."""

    causal_lm: Any  # a Hugging Face model (untyped)
    policy: Policy
    optimizer: torch.optim.Optimizer
    adapter: LoraConfig | None = None
    reference: Policy | None = None

    def gathered(self) -> tuple[dict[str, torch.Tensor], Iterator[dict[str, torch.Tensor]]]:
        """What a version publishes: its layout (the file's tensors in order, on the meta device for full weights)
        and its layers, gathered from the shards onto rank 0 as they are iterated (a collective every rank iterates
        to its end; empty on the other ranks): the whole model in its checkpoint's names, a decoder layer at a time
        (lockstep_workers.trainer.sharding), or the adapter alone under PEFT's file names
        (lockstep_workers.weights.lora), at once."""
        if self.adapter is None:
            return sharding.checkpoint_layout(self.causal_lm), sharding.gathered_layers(self.causal_lm)
        adapter = lora.file_names(sharding.full_state_dict(self.causal_lm, trainable_only=True))
        return adapter, iter([adapter])

    def metadata(self) -> dict[str, str] | None:
        """The header metadata of a version: a LoRA adapter's config, none for full weights."""
        return None if self.adapter is None else lora.adapter_metadata(self.adapter)

    def trainable(self) -> set[str]:
        """The names of the parameters that train (in the causal LM)."""
        return {name for name, parameter in self.causal_lm.named_parameters() if parameter.requires_grad}


def build(model_path: str, settings: Training, config: PodConfig | None, mesh: Any) -> TrainedModel:
    """Every rank: the model at ``model_path`` in fp32, with spec.trainer.lora's adapter injected (PEFT) when set,
    sharded over ``mesh`` (lockstep_workers.trainer.sharding) with the job's numerics (``config``; outside an RLJob's
    pod the policy defaults, in the checkpoint's dtype), and an AdamW optimizer of the parameters that train. With a KL
    coefficient and no LoRA, a second copy of the model, frozen and sharded alike (fp32 parameters, no gradients
    and no optimizer state: a quarter more than the trained copy's parameters, gradients and AdamW moments), is the
    reference: the model the job started from, also after a restart (in host memory with klReferenceOffload). A
    LoRA setting that does not fit the model stops the trainer (SystemExit) with the reason."""
    from transformers import AutoModelForCausalLM

    numerics = config.trainer if config is not None else TrainerNumerics()
    causal_lm = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)  # fp32 master weights
    adapter = None
    if settings.lora is not None:
        try:
            adapter = lora.adapter_config(settings.lora, causal_lm)
        except lora.LoraSettingsError as error:
            raise SystemExit(str(error)) from error
        lora.inject(causal_lm, adapter)
    dtype = compute_dtype(config.model.dtype if config is not None else DType.AUTO, model_path)
    fp32_head = numerics.lm_head_dtype is DType.FLOAT32
    policy = sharding.shard(
        causal_lm,
        mesh,
        compute_dtype=dtype,
        fp32_head=fp32_head,
        activation_checkpointing=settings.activation_checkpointing,
    )
    trains = [parameter for parameter in policy.parameters() if parameter.requires_grad]
    optimizer = optimization.adamw(trains, settings.objective)
    reference = None
    if settings.objective.kl_coefficient and adapter is None:
        frozen = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).requires_grad_(False)
        offload = settings.objective.kl_reference_offload
        reference = sharding.shard(frozen, mesh, compute_dtype=dtype, fp32_head=fp32_head, offload=offload)
    return TrainedModel(causal_lm, policy, optimizer, adapter, reference)


def restore(env: PodEnvironment, model: TrainedModel) -> Resumption:
    """Every rank: load what rank 0 decided to resume from into the shards; return that decision. A LoRA job loads
    a published version into its adapter (the base stays the model's own), and its checkpoints hold the adapter
    and its optimizer state alone."""
    device = sharding.accelerator(env.local_rank)
    decided: list[Any] = [None]
    if env.rank == 0:
        try:
            decided = [resumption(committed_weights(env), env.weights_dir, env.checkpoints_dir)]
            if model.adapter is not None and decided[0].first_step > 1:
                _check_adapter(version_path(env.weights_dir, decided[0].first_step - 1), model.adapter)
        except SystemExit as stop:  # every rank stops with it, rather than wait for rank 0
            decided = [stop]
    dist.broadcast_object_list(decided, src=0, device=device)
    if isinstance(decided[0], SystemExit):
        raise decided[0]
    resumed: Resumption = decided[0]
    adapter_only = model.adapter is not None
    if resumed.checkpoint is not None:
        path = checkpoint.step_path(env.checkpoints_dir, resumed.checkpoint)
        checkpoint.load(path, model.causal_lm, model.optimizer, device, trainable_only=adapter_only)
    if resumed.weights is not None:
        whole = {}
        if env.rank == 0:
            whole = (
                dict(tensors(resumed.weights))
                if adapter_only
                else sharding.memory_names(model.causal_lm, resumed.weights)
            )
        if adapter_only and env.rank == 0:
            try:
                whole = lora.live_names(whole)
            except ValueError as error:
                raise ValueError(f"the published weights {resumed.weights} are not a LoRA adapter: {error}") from error
            if set(whole) != model.trainable():
                differ = sorted(set(whole) ^ model.trainable())
                raise ValueError(f"the published adapter {resumed.weights} does not fit this model's: {differ[:5]}")
        unexpected = set(whole) - set(model.causal_lm.state_dict())
        if unexpected:
            raise ValueError(f"the published weights {resumed.weights} do not fit this model: {sorted(unexpected)[:5]}")
        sharding.load_full_state_dict(model.causal_lm, whole)
    return resumed


def _check_adapter(path: Path, adapter: LoraConfig) -> None:
    """Stop (SystemExit) unless the version at ``path`` was trained with the adapter that ``adapter`` describes."""
    try:
        published_config = lora.adapter_config_of(path)
    except ValueError as error:
        raise SystemExit(f"cannot resume this LoRA job: {error}") from error
    ours = json.loads(lora.config_json(adapter))
    fields = ("r", "lora_alpha", "target_modules", "bias", "use_dora", "use_rslora")
    changed = {name: (published_config.get(name), ours.get(name)) for name in fields}
    changed = {name: values for name, values in changed.items() if values[0] != values[1]}
    if changed:
        listed = ", ".join(f"{name} {was!r} -> {now!r}" for name, (was, now) in changed.items())
        raise SystemExit(
            f"cannot resume this LoRA job: spec.trainer.lora changed since {path.name} was published ({listed}); "
            "an adapter cannot be resumed with another shape: restore the settings, or start a new job"
        )


def compute_dtype(dtype: DType, model_path: str) -> torch.dtype:
    """The dtype the actors compute in, and so the trainer's layers: spec.model.dtype (auto: the checkpoint's)."""
    from transformers import AutoConfig

    if dtype is DType.AUTO:
        found: Any = AutoConfig.from_pretrained(model_path).dtype
        resolved: torch.dtype = found if isinstance(found, torch.dtype) else getattr(torch, found or "float32")
        return resolved
    chosen: torch.dtype = getattr(torch, dtype.value)
    return chosen


class Prompts:
    """Rank 0's prompts: each step's, from the job's dataset or its prompt source, and the eval split's; and the
    reward's view of their completions."""

    def __init__(self, settings: Training, model_path: str) -> None:
        from transformers import AutoTokenizer

        self.settings = settings
        self.tokenizer: Any = AutoTokenizer.from_pretrained(model_path)
        self.dataset: PromptDataset | None = None
        if settings.dataset is not None:
            try:
                self.dataset = PromptDataset(settings.dataset, self.tokenizer)
            except DatasetError as error:
                raise SystemExit(f"spec.trainer.dataset: {error}") from error
        self.source: PromptSource = load_callable(settings.prompts)
        self._steps: dict[int, list[Prompt]] = {}
        """The prompts of the steps whose positions are being sampled (a step's are made together)."""

    def step(self, step: int) -> list[Prompt]:
        count = self.settings.rollout.prompts_drawn_per_step
        if self.dataset is not None:
            return self.dataset.step_prompts(step, count)
        token_ids = self.source(step, count, self.settings.seed)
        return [Prompt(ids, self.tokenizer.decode(ids), {}) for ids in token_ids]

    def at(self, position: int) -> Prompt:
        """The prompt at ``position`` in the job's sequence (lockstep_workers.rollout.producer): step position // count
        + 1's prompt position % count, ``count`` the prompts each step draws."""
        count = self.settings.rollout.prompts_drawn_per_step
        step = position // count + 1
        if step not in self._steps:
            # Keep the step before (its dropped groups may be sampled again); an evicted step's are made again.
            self._steps = {s: p for s, p in self._steps.items() if s >= step - 1}
            self._steps[step] = self.step(step)
        return self._steps[step][position % count]

    def evaluation(self) -> list[Prompt]:
        return self.dataset.eval_prompts(self.settings.eval.prompts) if self.dataset is not None else []

    def reward_inputs(self, rollouts: list[Rollout], prompts: list[Prompt]) -> list[RewardInput]:
        return [
            RewardInput(
                r.prompt,
                r.completion,
                prompts[r.group].text,
                self.tokenizer.decode(r.completion, skip_special_tokens=True),
                prompts[r.group].row,
            )
            for r in rollouts
        ]


def evaluate(producer: RolloutProducer, prompts: Prompts, scorer: Scorer, max_tokens: int) -> dict[str, float]:
    """The mean reward of one greedy completion of each eval row, from the actors (beside the training requests),
    and how many rows."""
    evaluated = prompts.evaluation()
    sampled = producer.evaluate([p.token_ids for p in evaluated], {**GREEDY, "max_tokens": max_tokens})
    rewards = scorer.scores(prompts.reward_inputs(sampled, evaluated)).rewards
    return {EVAL_REWARD: sum(rewards) / len(rewards), EVAL_ROWS: float(len(rewards))}


def score_group(
    prompts: Prompts, scorer: Scorer, rollout: RolloutSettings, rollouts: list[Rollout], prompt: Prompt
) -> tuple[list[RewardInput], Scores]:
    """What the reward saw of one prompt's samples (``rollouts``, of group 0) and their rewards, each with its
    overlong penalty (spec.trainer.rollout.overlong) added."""
    inputs = prompts.reward_inputs(rollouts, [prompt])
    scores = scorer.scores(inputs)
    penalised = penalties(rollouts, rollout.max_tokens, rollout.overlong)
    rewards = [reward + penalty for reward, penalty in zip(scores.rewards, penalised, strict=True)]
    return inputs, replace(scores, rewards=rewards)


def batch_of(groups: Sequence[Group]) -> tuple[list[Rollout], list[RewardInput], list[float], int]:
    """A step's rollouts (group n: its nth prompt), what the reward saw of them, their rewards and reward errors."""
    rollouts = [replace(r, group=n) for n, group in enumerate(groups) for r in group.rollouts]
    inputs = [sample for group in groups for sample in group.inputs]
    rewards = [reward for group in groups for reward in group.rewards]
    return rollouts, inputs, rewards, sum(group.reward_errors for group in groups)


def dynamic_sampling_metrics(taken: StepGroups) -> dict[str, float]:
    """What dynamic sampling cost a step (spec.trainer.rollout.dynamicSampling): the groups it dropped for equal
    rewards, those it sampled beyond promptsPerStep, and those without signal it learned because its extra groups
    ran out."""
    return {
        "dropped_groups": float(taken.dropped),
        "extra_groups": float(taken.extra),
        "unfilled_groups": float(taken.unfilled),
    }


def reward_part_metrics(groups: Sequence[Group]) -> dict[str, float]:
    """Each reward function's mean reward over the step's completions, before its weight, as rewards/<name>."""
    names = groups[0].reward_parts
    return {
        f"{REWARD_PART_PREFIX}{name}": sum(sum(g.reward_parts[name]) for g in groups)
        / sum(len(g.rewards) for g in groups)
        for name in names
    }


def pipeline_metrics(
    rollouts: Sequence[Rollout], version: int, max_lag: int, generated: int, interval: float, busy: float | None
) -> dict[str, float]:
    """Where the step's time went, beside its learn and wait seconds: tokens generated (``generated``, by the
    actors, kept or dropped) and learned per second of ``interval`` (since the previous step's), the actors' busy
    fraction (``busy``; left out when no actor reports it), the sequences learned at each lag behind ``version``
    (``lag_<n>_sequences``, n from 0 to ``max_lag``) and how many span versions."""
    learned = sum(len(r.completion) for r in rollouts)
    lags = [lag_of(r, version) for r in rollouts]
    metrics = {
        "tokens_generated_per_second": generated / interval,
        "tokens_learned_per_second": learned / interval,
        "spanning_sequences": float(sum(len(set(r.versions)) > 1 for r in rollouts)),
        **{f"{LAG_PREFIX}{n}{LAG_SUFFIX}": float(lags.count(n)) for n in range(max_lag + 1)},
    }
    if busy is not None:
        metrics["actor_busy_fraction"] = busy
    return metrics


def busy_fraction(before: dict[str, float], after: dict[str, float], interval: float) -> float | None:
    """The mean over the actors that reported both times of their busy share of ``interval``."""
    shares = [min(1.0, (after[url] - before[url]) / interval) for url in after if url in before]
    return sum(shares) / len(shares) if shares else None


def train(model_path: str, settings: Training, env: PodEnvironment, actors: Actors) -> None:
    """The whole job, as one rank: ``settings.steps`` steps; rank 0 samples from ``actors``, publishes and
    announces each version."""
    if env.shared_dir is None:
        raise SystemExit(
            f"{environment.SHARED_DIR} is not set: the operator sets it to the directory for the job's weights and "
            "metrics; run the trainer as the operator renders it"
        )
    if settings.lora is not None and env.weight_sync.collective:
        raise SystemExit(
            f"spec.trainer.lora needs spec.weightSync.backend filesystem, not {env.weight_sync.value}: each version "
            "is a LoRA adapter published as a file, which the collective backends do not send"
        )
    if env.rank != 0:
        _train(model_path, settings, env, actors, None)
        return
    # Rank 0: fork the reward's processes before any thread starts; stop them however training ends.
    env.shared_dir.mkdir(parents=True, exist_ok=True)
    with Scorer(settings.reward_functions(), settings.on_reward_error, settings.reward_processes) as scorer:
        _train(model_path, settings, env, actors, scorer)


def _train(model_path: str, settings: Training, env: PodEnvironment, actors: Actors, scorer: Scorer | None) -> None:
    """``train`` on one rank; rank 0 scores with ``scorer``."""
    leader = scorer is not None
    prompts = Prompts(settings, model_path) if leader else None

    # Join the ranks' group on this rank's accelerator, shard the model over them, resume where the job was.
    device = sharding.accelerator(env.local_rank)
    mesh = sharding.start(env.rank, env.world_size, device)
    torch.manual_seed(settings.seed)
    config = env.config  # outside an RLJob's pod: the policy defaults, in the checkpoint's dtype
    budget = (config.mismatch_budget if config is not None else MismatchBudget()).mean_abs_logprob_diff
    model = build(model_path, settings, config, mesh)
    resumed = restore(env, model)
    learning_rates = optimization.scheduler(model.optimizer, settings.objective, settings.steps, resumed.first_step)
    rollout = settings.rollout
    sampling = {"temperature": rollout.temperature, "top_p": rollout.top_p, "max_tokens": rollout.max_tokens}

    # Rank 0: serve the metrics, and with a collective backend the weights; wait until every actor serves; start
    # the rollout producer from the first position of the first step.
    sending: Sending | None = None
    producer: RolloutProducer | None = None
    tracking: Runs | None = None
    tracer: Tracer | None = None
    if leader:
        tracer = tracing.tracer(os.environ, traces.TRAINER_SERVICE)
        if env.metrics_port:
            start_http_server(env.metrics_port)
        tracking = open_runs(settings.tracking, env.shared_dir, resumed.first_step, config, env.job, env.namespace)
        if env.weight_sync.collective:
            sending = Sending(env)
        if resumed.announce_again is not None and env.pod and env.namespace:
            logger.info("announcing weights version %d again, for the actors to load", resumed.announce_again.version)
            announce(_as_announced(env, resumed.announce_again), env.namespace, env.pod)
        actors.wait_until_ready()
        assert prompts is not None and scorer is not None
        count = rollout.prompts_drawn_per_step
        schedule = Schedule(
            rollout.prompts_per_step,
            settings.max_lag,
            rollout.in_flight,
            (resumed.first_step - 1) * count,
            settings.steps * count,
            on_policy_groups=rollout.on_policy_groups,
            extra_groups=rollout.extra_groups,
        )
        score = functools.partial(score_group, prompts, scorer, rollout)
        producer = RolloutProducer(actors, schedule, prompts.at, rollout.samples_per_prompt, sampling, score)
        producer.start()
    finished = False
    try:
        _steps(
            settings,
            env,
            resumed.first_step,
            producer,
            prompts,
            scorer,
            model,
            learning_rates,
            budget,
            model_path,
            tracking,
            tracer,
        )
        finished = True
    finally:
        if producer is not None:
            producer.close()
        if tracking is not None:
            tracking.close(finished)
    if sending is not None:
        logger.info("waiting for the actors to receive the final weights version %d from this pod", settings.steps)
        actors.wait_for_version(settings.steps)
        sending.close(final=settings.steps)
    dist.destroy_process_group()


def _steps(
    settings: Training,
    env: PodEnvironment,
    first_step: int,
    producer: RolloutProducer | None,
    prompts: Prompts | None,
    scorer: Scorer | None,
    model: TrainedModel,
    learning_rates: torch.optim.lr_scheduler.LRScheduler,
    budget: float,
    model_path: str,
    tracking: Runs | None = None,
    tracer: Tracer | None = None,
) -> None:
    """The steps from ``first_step``, on every rank (``learning_rates`` at ``first_step``'s rate); rank 0 (with the
    ``producer``) takes, publishes, records (also to the ``tracking`` runs, and each step's trace to ``tracer``), and
    writes spec.output when due."""
    rollout = settings.rollout
    every = settings.eval.every_steps
    device = sharding.accelerator(env.local_rank)
    publisher = Publisher() if producer is not None else None
    waited = 0.0  # how long rank 0 has waited for a publish since it handed over the last one
    handed_over = time.monotonic()  # when rank 0 handed over the previous step's publish
    busy = producer.busy_seconds() if producer is not None else {}
    generated = 0
    output = env.config.output if env.config is not None else None
    last_evaluation: tuple[int, float] | None = None  # rank 0: (the version evaluated, its eval reward)
    for step in range(first_step, settings.steps + 1):
        started = time.monotonic()
        epoch = time.time() - started  # monotonic → seconds since the epoch, for the step's trace

        # Evaluate (rank 0, when due): once the actors serve the weights this step starts from, beside the
        # training requests. Take (rank 0) this step's promptsPerStep groups of samplesPerPrompt completions,
        # scored, from the producer, once the publish of the version maxLag behind this step's is written.
        batch: list[Any] = [None]
        if producer is not None:
            assert prompts is not None and scorer is not None and publisher is not None
            evaluation: dict[str, float] = {}
            if every and (step - 1) % every == 0:
                waited += publisher.wait_for(step - 1)
                producer.actors.wait_for_version(step - 1)
                evaluation = evaluate(producer, prompts, scorer, rollout.max_tokens)
                if EVAL_REWARD in evaluation:
                    last_evaluation = (step - 1, evaluation[EVAL_REWARD])
            waited += publisher.wait_for(step - 1 - settings.max_lag)
            dropped = producer.counts.samples_dropped
            taking = time.monotonic()
            taken = producer.take(step)
            sampled, inputs, scored, errors = batch_of(taken.groups)
            counts = {
                **overlong_metrics(sampled, rollout.max_tokens, rollout.overlong),
                "rollout_wait_seconds": time.monotonic() - taking,
                "reward_errors": float(errors),
                "stale_samples_dropped": float(producer.counts.samples_dropped - dropped),
                **(dynamic_sampling_metrics(taken) if rollout.dynamic_sampling else {}),
                **(reward_part_metrics(taken.groups) if settings.rewards is not None else {}),
            }
            record_rollouts(env, step, inputs, scored)
            batch = [(masked_if_cut(sampled, rollout.max_tokens, rollout.overlong), scored, {**counts, **evaluation})]

        # Share: every rank gets the batch, and learns from its own prompt groups.
        dist.broadcast_object_list(batch, src=0, device=device)
        everything, rewards, scoring = batch[0]
        mine = [n for n, r in enumerate(everything) if r.group % env.world_size == env.rank]

        # Learn: minibatches of micro-batches; FSDP reduces the gradients, and the metrics are combined here.
        learning = time.monotonic()
        metrics = learn(
            model.policy,
            model.optimizer,
            [everything[n] for n in mine],
            [rewards[n] for n in mine],
            settings.objective,
            rollout.temperature,
            top_p=rollout.top_p,
            version=step - 1,
            max_lag=settings.max_lag,
            max_tokens=rollout.max_tokens,
            reference=model.reference,
            replay_routing=env.config is not None and env.config.routing_replay,
        )
        metrics = across_ranks(metrics, device)
        metrics["learn_seconds"] = time.monotonic() - learning
        metrics["learning_rate"] = float(learning_rates.get_last_lr()[0])
        learning_rates.step()
        metrics["reward"] = sum(rewards) / len(rewards)  # over the whole batch, not a shard
        metrics.update(scoring)

        # Publish the weights gathered from the shards (a collective, a snapshot) as version ``step``: rank 0
        # waits for its previous publish if that is still in flight, then writes the file in the background as the
        # layers are gathered (the gather waits for the write only past PUBLISH_BUFFER_BYTES), and announces the
        # version and records the step in the background while the next step runs. Checkpoint the shards when due,
        # once this version is on disk, so that no checkpoint is newer than the newest published version.
        layout, layers = model.gathered()
        writing = None
        if publisher is not None:
            waited += publisher.wait()
            # The committed version, which new actors start from, is at most maxLag + 1 versions behind this one.
            keep = max(3, settings.max_lag + 2)
            writing = StreamedPublish(layout, env.weights_dir, step, keep, model.metadata())
        gathering = time.monotonic()
        for layer in layers:
            if writing is not None:
                writing.put(layer)
        if writing is not None:
            writing.close()
        gathered = time.monotonic() - gathering
        if publisher is not None and producer is not None:
            assert writing is not None
            metrics.update(publish_gather_seconds=gathered, publish_wait_seconds=waited)
            now = time.monotonic()
            seconds, interval, handed_over = now - started, now - handed_over, now
            busy, before = producer.busy_seconds(), busy
            generated, before_generated = producer.counts.tokens_generated, generated
            metrics.update(
                pipeline_metrics(
                    everything,
                    step - 1,
                    settings.max_lag,
                    generated - before_generated,
                    interval,
                    busy_fraction(before, busy, interval),
                )
            )
            then = None
            if output is not None and output_due(step, settings.steps, output.every_steps):
                then = functools.partial(write_output, env, output, model_path, step, last_evaluation)
            starts = {"sampling_wait": taking + epoch, "learn": learning + epoch, "gather": gathering + epoch}
            trace = (tracer, started + epoch, starts) if tracer is not None else None
            work = functools.partial(
                _publish_and_announce,
                env,
                settings,
                step,
                writing,
                metrics,
                seconds,
                budget,
                then,
                tracking,
                trace,
            )
            publisher.start(step, work)
            waited = 0.0
        if settings.checkpoint_every_steps and step % settings.checkpoint_every_steps == 0:
            if publisher is not None:
                waited += publisher.wait()
            checkpoint.save(
                env.checkpoints_dir,
                step,
                model.causal_lm,
                model.optimizer,
                device,
                settings.checkpoints_kept,
                trainable_only=model.adapter is not None,
            )
    if publisher is not None:
        publisher.wait()


def _publish_and_announce(
    env: PodEnvironment,
    settings: Training,
    step: int,
    writing: StreamedPublish,
    metrics: dict[str, float],
    seconds: float,
    budget: float,
    then: Callable[[], object] | None = None,
    tracking: Runs | None = None,
    trace: tuple[Tracer, float, dict[str, float]] | None = None,
) -> None:
    """Rank 0, in the background: wait for ``writing``, version ``step``'s file, to be written, announce it and the
    step's mismatch on the pod, record the step (``seconds``: its time on the trainer's path; also to
    the ``tracking`` runs, and with ``trace``, the tracer, when the step started and when its parts did, its trace), log
    it; then run ``then`` (spec.output's write, when due)."""
    weights = writing.result()
    assert writing.seconds is not None, "measured once the write ended"
    metrics = {**metrics, "publish_seconds": writing.seconds}
    if env.pod and env.namespace:
        mismatch, evaluation = step_reports(step, metrics)
        announce(_as_announced(env, weights), env.namespace, env.pod, mismatch, evaluation)
    record(env, step, seconds, metrics, tracking)
    if trace is not None:
        tracer, started, starts = trace
        starts = {**starts, "publish": writing.started}
        tracing.emit(tracer, traces.step_span(step, started, seconds, starts, metrics, env.pod, env.namespace))
    measured = metrics.get(ONPOLICY_MISMATCH)
    if measured is not None and measured > budget:
        logger.warning(
            "step %d: mean |logprob difference| %.2e on on-policy tokens exceeds the ParityPolicy budget %.2e",
            step,
            measured,
            budget,
        )
    logger.info(
        "step %d/%d: reward %.3f, clip rate %.3f, KL %.2e, ESS %.3f, on-policy |Δlogprob| %s, staleness %d, %.1fs; "
        "announced weights version "
        "%d (blocked %.2fs gathering and %.2fs waiting for the previous publish; written in %.2fs in the background)",
        step,
        settings.steps,
        metrics["reward"],
        metrics["clamp_log_ratio_new_old_indicator"],
        metrics["kl_new_old"],
        metrics["ess"],
        "none (no token sampled under the trainer's weights)" if measured is None else f"{measured:.2e}",
        metrics["staleness"],
        seconds,
        step,
        metrics["publish_gather_seconds"],
        metrics["publish_wait_seconds"],
        metrics["publish_seconds"],
    )
    if then is not None:
        then()


def output_due(step: int, steps: int, every_steps: int) -> bool:
    """Whether spec.output is written after ``step`` of ``steps``: at the last, and every ``every_steps`` (0: never
    before the last)."""
    return step == steps or (every_steps > 0 and step % every_steps == 0)


def write_output(
    env: PodEnvironment, output: Output, model_path: str, version: int, last_evaluation: tuple[int, float] | None
) -> OutputResult:
    """Rank 0, once ``version`` is published: write it to spec.output (lockstep_workers.export) and report it on the
    pod (lockstep.dev/output), with ``last_evaluation`` (the version evaluated and its eval reward), if any; return
    the report."""
    writing = time.monotonic()
    path, digest = export.write_version(
        env.weights_dir, version, model_path, Path(output.path), output.dtype, output.merged
    )
    evaluated, reward = last_evaluation if last_evaluation is not None else (None, None)
    result = OutputResult(
        path=str(path), version=version, step=version, eval_reward=reward, eval_version=evaluated, digest=digest
    )
    if env.pod and env.namespace:
        report_output(result, env.namespace, env.pod)
    logger.info(
        "wrote weights version %d to %s in %.1fs (%s); serve it with: %s",
        version,
        path,
        time.monotonic() - writing,
        digest,
        export.serve_command(path),
    )
    return result


def _as_announced(env: PodEnvironment, weights: Weights) -> Weights:
    """``weights`` as rank 0 announces them: with a collective backend, at its manifest's URL."""
    if not env.weight_sync.collective:
        return weights
    return weights.model_copy(update={"uri": manifest_uri(env.weights_host, env.weights_port, weights.version)})


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m lockstep_workers.trainer", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="path of the base model")
    options = parser.parse_args()
    faulthandler.enable()  # a crash in native code (torch, gloo, NCCL) leaves its stack in the pod log
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    env = PodEnvironment.from_environ(os.environ)
    if env.config is None:
        raise SystemExit(
            f"{environment.CONFIG} is not set: the trainer runs the training settings of the job's configuration, "
            "which the operator mounts in its pods; run the trainer as the operator renders its pod"
        )
    settings = env.config.training
    function = load_rollout_function(settings.rollout.function)
    actors = ActorService(discovery(env.actors_service, env.namespace, env.actors), function=function)
    train(options.model, settings, env, actors)
