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
import contextlib
import faulthandler
import functools
import logging
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist
from opentelemetry.trace import Tracer
from prometheus_client import start_http_server

from lockstep import environment, protocol, tracing
from lockstep.api import MismatchBudget, Training
from lockstep.protocol import Weights
from lockstep_workers.rollout.client import Actors, ActorService, discovery
from lockstep_workers.rollout.producer import RolloutProducer, Schedule
from lockstep_workers.rollout.record import Rollout
from lockstep_workers.rollout.scoring import Scorer
from lockstep_workers.trainer import checkpoint, optimization, sharding, traces
from lockstep_workers.trainer.evaluation import evaluate, evaluation_due
from lockstep_workers.trainer.learner import across_ranks, learn
from lockstep_workers.trainer.metrics import (
    busy_fraction,
    dynamic_sampling_metrics,
    pipeline_metrics,
    reward_part_metrics,
)
from lockstep_workers.trainer.model import TrainedModel, build, restore
from lockstep_workers.trainer.objective import ONPOLICY_MISMATCH
from lockstep_workers.trainer.output import output_due, write_output
from lockstep_workers.trainer.pod import (
    EVAL_REWARD,
    PodEnvironment,
    Sending,
    announce,
    record,
    record_rollouts,
    step_reports,
)
from lockstep_workers.trainer.sampling import Prompts, batch_of, load_rollout_function, score_group
from lockstep_workers.trainer.shaping import masked_if_cut, overlong_metrics
from lockstep_workers.trainer.tracking import Runs, open_runs
from lockstep_workers.weights.files import (
    Publisher,
    StreamedPublish,
)
from lockstep_workers.weights.transfer import manifest_uri

logger = logging.getLogger("lockstep.trainer")

TERMINATION_LOG = Path("/dev/termination-log")
"""Where the kubelet takes a container's termination message from (the trainer container's default
terminationMessagePath): a file it mounts there, which the operator quotes the last line of in the job's condition
(lockstep.reconcile.restarts)."""


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


@dataclass
class LeaderAccount:
    """Rank 0's running account between steps: how long it has waited for a publish since it handed over the last
    one, when it handed that one over, the actors' busy seconds and the tokens generated as of then, and the last
    evaluation (the version evaluated, its eval reward)."""

    busy: dict[str, float]
    waited: float = 0.0
    handed_over: float = field(default_factory=time.monotonic)
    generated: int = 0
    last_evaluation: tuple[int, float] | None = None


@dataclass(frozen=True)
class Leader:
    """Rank 0's side of the steps: the rollout producer and the prompts and scorer it samples with, the background
    publisher of each version, the experiment tracking runs and the tracer of the steps' traces, and its account."""

    producer: RolloutProducer
    prompts: Prompts
    scorer: Scorer
    publisher: Publisher
    tracking: Runs | None
    tracer: Tracer | None
    account: LeaderAccount


@dataclass(frozen=True)
class Run:
    """What the steps run with, on every rank: the job's training settings, this pod's environment, the base model's
    path, this rank's model and its learning rates (at ``first_step``'s rate), the ParityPolicy's mismatch budget, on
    rank 0 its ``leader`` side, and the optimiser steps skipped in a row."""

    settings: Training
    env: PodEnvironment
    model_path: str
    model: TrainedModel
    learning_rates: torch.optim.lr_scheduler.LRScheduler
    first_step: int
    budget: float
    leader: Leader | None
    skipped: optimization.SkippedSteps = field(default_factory=optimization.SkippedSteps)
    """The optimiser steps skipped in a row for a gradient norm that is not finite, across the steps."""


@dataclass(frozen=True)
class Sampled:
    """A step's batch as rank 0 shares it with every rank: the rollouts (group n: the step's nth prompt), their
    rewards, and the step's sampling, scoring and evaluation metrics."""

    rollouts: list[Rollout]
    rewards: list[float]
    metrics: dict[str, float]


def _train(model_path: str, settings: Training, env: PodEnvironment, actors: Actors, scorer: Scorer | None) -> None:
    """``train`` on one rank; rank 0 scores with ``scorer``."""
    # Join the ranks' group on this rank's accelerator, shard the model over them, resume where the job was.
    device = sharding.accelerator(env.local_rank)
    mesh = sharding.start(env.rank, env.world_size, device)
    torch.manual_seed(settings.seed)
    config = env.config  # outside an RLJob's pod: the policy defaults, in the checkpoint's dtype
    budget = (config.mismatch_budget if config is not None else MismatchBudget()).mean_abs_logprob_diff
    model = build(model_path, settings, config, mesh)
    resumed = restore(env, model)
    learning_rates = optimization.scheduler(model.optimizer, settings.objective, settings.steps, resumed.first_step)

    # Rank 0: serve the metrics, and with a collective backend the weights; wait until every actor serves; start
    # the rollout producer from the first position of the first step.
    sending: Sending | None = None
    leader: Leader | None = None
    if scorer is not None:
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
        prompts = Prompts(settings, model_path)
        producer = _producer(settings, actors, prompts, scorer, resumed.first_step)
        account = LeaderAccount(busy=producer.busy_seconds())
        leader = Leader(producer, prompts, scorer, Publisher(), tracking, tracer, account)
    finished = False
    try:
        _steps(Run(settings, env, model_path, model, learning_rates, resumed.first_step, budget, leader))
        finished = True
    finally:
        if leader is not None:
            leader.producer.close()
            if leader.tracking is not None:
                leader.tracking.close(finished)
    if sending is not None:
        logger.info("waiting for the actors to receive the final weights version %d from this pod", settings.steps)
        actors.wait_for_version(settings.steps)
        sending.close(final=settings.steps)
    dist.destroy_process_group()


def _producer(settings: Training, actors: Actors, prompts: Prompts, scorer: Scorer, first_step: int) -> RolloutProducer:
    """Rank 0's rollout producer, started from the first position of ``first_step``: it keeps prompt groups in flight
    on ``actors`` within maxLag, each scored with ``scorer``."""
    rollout = settings.rollout
    count = rollout.prompts_drawn_per_step
    schedule = Schedule(
        rollout.prompts_per_step,
        settings.max_lag,
        rollout.in_flight,
        (first_step - 1) * count,
        settings.steps * count,
        on_policy_groups=rollout.on_policy_groups,
        extra_groups=rollout.extra_groups,
    )
    sampling = {"temperature": rollout.temperature, "top_p": rollout.top_p, "max_tokens": rollout.max_tokens}
    score = functools.partial(score_group, prompts, scorer, rollout)
    producer = RolloutProducer(actors, schedule, prompts.at, rollout.samples_per_prompt, sampling, score)
    producer.start()
    return producer


def _steps(run: Run) -> None:
    """The steps from ``run.first_step``, on every rank; rank 0 (``run.leader``) samples, evaluates, publishes and
    records each one, and writes spec.output when due."""
    settings, env, leader = run.settings, run.env, run.leader
    device = sharding.accelerator(env.local_rank)
    for step in range(run.first_step, settings.steps + 1):
        started = time.monotonic()
        epoch = time.time() - started  # monotonic → seconds since the epoch, for the step's trace

        # Sample (rank 0): evaluate first when due, then take this step's scored prompt groups from the producer.
        shared: list[Sampled | None] = [None]
        taking = started
        if leader is not None:
            evaluation = _evaluate(run, leader, step)
            sampled, taking = _sample(run, leader, step)
            shared = [replace(sampled, metrics={**sampled.metrics, **evaluation})]

        # Share: every rank gets the batch, and learns from its own prompt groups.
        dist.broadcast_object_list(shared, src=0, device=device)
        batch = shared[0]
        assert batch is not None, "rank 0 shared its batch"

        # Learn: minibatches of micro-batches; FSDP reduces the gradients, and the metrics are combined here.
        learning = time.monotonic()
        metrics = _learn(run, step, batch, device)

        # Publish the weights gathered from the shards as version ``step``, and (rank 0) hand over its announcement
        # and the step's record to the background while the next step runs.
        writing, gathering = _publish(run, step)
        metrics["publish_gather_seconds"] = time.monotonic() - gathering
        if leader is not None and writing is not None:
            starts = {"sampling_wait": taking + epoch, "learn": learning + epoch, "gather": gathering + epoch}
            _record(run, leader, step, batch, metrics, writing, started, epoch, starts)

        # Checkpoint the shards when due, once this version is on disk, so that no checkpoint is newer than the newest
        # published version.
        if settings.checkpoint_every_steps and step % settings.checkpoint_every_steps == 0:
            if leader is not None:
                leader.account.waited += leader.publisher.wait()
            checkpoint.save(
                env.checkpoints_dir,
                step,
                run.model.causal_lm,
                run.model.optimizer,
                device,
                settings.checkpoints_kept,
                trainable_only=run.model.adapter is not None,
            )
    if leader is not None:
        leader.publisher.wait()


def _evaluate(run: Run, leader: Leader, step: int) -> dict[str, float]:
    """Rank 0, when spec.trainer.eval is due before ``step``: the eval metrics of the weights the step starts from,
    once the actors serve them, sampled beside the training requests; none when not due."""
    if not evaluation_due(step, run.settings.eval.every_steps):
        return {}
    leader.account.waited += leader.publisher.wait_for(step - 1)
    leader.producer.actors.wait_for_version(step - 1)
    evaluation = evaluate(leader.producer, leader.prompts, leader.scorer, run.settings.rollout.max_tokens)
    if EVAL_REWARD in evaluation:
        leader.account.last_evaluation = (step - 1, evaluation[EVAL_REWARD])
    return evaluation


def _sample(run: Run, leader: Leader, step: int) -> tuple[Sampled, float]:
    """Rank 0: this step's promptsPerStep groups of samplesPerPrompt completions, scored, taken from the producer once
    the publish of the version maxLag behind this step's is written (its completions recorded), and when the taking
    began."""
    rollout, producer = run.settings.rollout, leader.producer
    leader.account.waited += leader.publisher.wait_for(step - 1 - run.settings.max_lag)
    dropped = producer.counts.samples_dropped
    taking = time.monotonic()
    taken = producer.take(step)
    rollouts, inputs, rewards, errors = batch_of(taken.groups)
    metrics = {
        **overlong_metrics(rollouts, rollout.max_tokens, rollout.overlong),
        "rollout_wait_seconds": time.monotonic() - taking,
        "reward_errors": float(errors),
        "stale_samples_dropped": float(producer.counts.samples_dropped - dropped),
        **(dynamic_sampling_metrics(taken) if rollout.dynamic_sampling else {}),
        **(reward_part_metrics(taken.groups) if run.settings.rewards is not None else {}),
    }
    record_rollouts(run.env, step, inputs, rewards)
    return Sampled(masked_if_cut(rollouts, rollout.max_tokens, rollout.overlong), rewards, metrics), taking


def _learn(run: Run, step: int, batch: Sampled, device: torch.device) -> dict[str, float]:
    """Every rank: learn from its own prompt groups of ``batch`` and step the learning rate; the step's metrics,
    combined over the ranks, with the batch's reward and its sampling metrics."""
    settings, env, rollout = run.settings, run.env, run.settings.rollout
    learning = time.monotonic()
    mine = [n for n, r in enumerate(batch.rollouts) if r.group % env.world_size == env.rank]
    metrics = learn(
        run.model.policy,
        run.model.optimizer,
        [batch.rollouts[n] for n in mine],
        [batch.rewards[n] for n in mine],
        settings.objective,
        rollout.temperature,
        top_p=rollout.top_p,
        version=step - 1,
        max_lag=settings.max_lag,
        max_tokens=rollout.max_tokens,
        reference=run.model.reference,
        replay_routing=env.config is not None and env.config.routing_replay,
        skipped=run.skipped,
    )
    metrics = across_ranks(metrics, device)
    metrics["learn_seconds"] = time.monotonic() - learning
    metrics["learning_rate"] = float(run.learning_rates.get_last_lr()[0])
    run.learning_rates.step()
    metrics["reward"] = sum(batch.rewards) / len(batch.rewards)  # over the whole batch, not a shard
    metrics.update(batch.metrics)
    return metrics


def _publish(run: Run, step: int) -> tuple[StreamedPublish | None, float]:
    """Every rank: gather the weights from the shards (a collective, a snapshot) as version ``step``; rank 0 first
    waits for its previous publish if that is still in flight, then writes the file in the background as the layers
    are gathered (the gather waits for the write only past PUBLISH_BUFFER_BYTES). Rank 0's write (None on the other
    ranks) and when the gather began."""
    layout, layers = run.model.gathered()
    writing = None
    if run.leader is not None:
        run.leader.account.waited += run.leader.publisher.wait()
        # The committed version, which new actors start from, is at most maxLag + 1 versions behind this one.
        keep = max(3, run.settings.max_lag + 2)
        writing = StreamedPublish(layout, run.env.weights_dir, step, keep, run.model.metadata())
    gathering = time.monotonic()
    for layer in layers:
        if writing is not None:
            writing.put(layer)
    if writing is not None:
        writing.close()
    return writing, gathering


def _record(
    run: Run,
    leader: Leader,
    step: int,
    batch: Sampled,
    metrics: dict[str, float],
    writing: StreamedPublish,
    started: float,
    epoch: float,
    starts: dict[str, float],
) -> None:
    """Rank 0: add where the step's time went to its ``metrics``, and hand version ``step``'s publish over to the
    background: announce it, record the step (to the tracking runs, and its trace from ``started`` with its parts'
    ``starts``, seconds since the epoch), then write spec.output when due."""
    settings, account, producer = run.settings, leader.account, leader.producer
    metrics["publish_wait_seconds"] = account.waited
    now = time.monotonic()
    seconds, interval, account.handed_over = now - started, now - account.handed_over, now
    busy, before = producer.busy_seconds(), account.busy
    generated, before_generated = producer.counts.tokens_generated, account.generated
    account.busy, account.generated = busy, generated
    metrics.update(
        pipeline_metrics(
            batch.rollouts,
            step - 1,
            settings.max_lag,
            generated - before_generated,
            interval,
            busy_fraction(before, busy, interval),
        )
    )
    output = run.env.config.output if run.env.config is not None else None
    then = None
    if output is not None and output_due(step, settings.steps, output.every_steps):
        then = functools.partial(write_output, run.env, output, run.model_path, step, account.last_evaluation)
    trace = (leader.tracer, started + epoch, starts) if leader.tracer is not None else None
    work = functools.partial(
        _publish_and_announce,
        run.env,
        settings,
        step,
        writing,
        metrics,
        seconds,
        run.budget,
        then,
        leader.tracking,
        trace,
    )
    leader.publisher.start(step, work)
    account.waited = 0.0


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
    if metrics.get("skipped_optimizer_steps"):
        logger.warning(
            "step %d: %d of its optimiser steps skipped, their gradient norm not finite (skipped_optimizer_steps)",
            step,
            metrics["skipped_optimizer_steps"],
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
    run_saying_why_it_stops(functools.partial(train, options.model, settings, env, actors))


def run_saying_why_it_stops(work: Callable[[], None], path: Path = TERMINATION_LOG) -> None:
    """Run ``work`` (the training). When it fails, why goes to the termination message at ``path``; a failure no
    restart can help (NonFiniteGradients) exits with protocol.TRAINER_GAVE_UP_EXIT_CODE, which fails the job."""
    try:
        work()
    except optimization.NonFiniteGradients as error:
        write_termination_message(error, path)
        logger.error("the trainer stops for good, the job with it: %s", error)
        raise SystemExit(protocol.TRAINER_GAVE_UP_EXIT_CODE) from error
    except (Exception, SystemExit) as error:
        write_termination_message(error, path)
        raise


def write_termination_message(error: BaseException, path: Path = TERMINATION_LOG) -> None:
    """Why the trainer stops, as its traceback's last line says it (a SystemExit: its message), written to ``path``
    when the kubelet mounted it there (nothing is written elsewhere): the job's condition then quotes it whatever the
    process logs after it (torch.distributed's warnings at exit), where the fallback to the log's last line would
    quote those."""
    if not path.exists():
        return
    said = str(error.code) if isinstance(error, SystemExit) else "".join(traceback.format_exception_only(error))
    with contextlib.suppress(OSError):  # never in the way of the error itself
        path.write_text(said.strip() + "\n")
