"""The trainer's pod I/O: what the operator set in its environment, what it announces on its own pod, the
job's committed weights, the step's record (metrics.jsonl and Prometheus; its completions in rollouts.jsonl), and
the sending of weights with a collective backend."""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import Gauge, Histogram

from lockstep import environment, keys
from lockstep.api import BudgetMetric, WeightSyncBackend
from lockstep.podconfig import PodConfig, load_pod_config
from lockstep.protocol import EvalResult, Mismatch, OutputResult, Weights, document
from lockstep_workers.rollout.scoring import RewardInput
from lockstep_workers.trainer import routing
from lockstep_workers.trainer.checkpoint import checkpoints_directory
from lockstep_workers.trainer.objective import ONPOLICY_MISMATCH
from lockstep_workers.weights.files import weights_directory
from lockstep_workers.weights.transfer import ManifestServer, Sender

if TYPE_CHECKING:
    from lockstep_workers.agent.core import AgentCore
    from lockstep_workers.trainer.tracking import Runs

logger = logging.getLogger("lockstep.trainer")

STEP_METRICS = (
    "reward",
    "reward_errors",
    "entropy",
    "clamp_log_ratio_new_old_indicator",
    "pg_clipfrac_lower",
    "kl_new_old",
    "ess",
    "mean_abs_logprob_diff",
    ONPOLICY_MISMATCH,
    "onpolicy_token_fraction",
    "spanning_sequence_fraction",
    "staleness",
    "stale_samples_dropped",
    "outside_top_p_fraction",
    "tis_weight_mean",
    "rollout_is_mean",
    "rollout_is_eff_sample_size",
    "rollout_is_ratio_fraction_high",
    "rollout_is_ratio_fraction_low",
    "rollout_is_masked_fraction",
    "rollout_is_veto_fraction",
    "training_ppl",
    "rollout_ppl",
    "log_ppl_diff",
    "k3_kl",
    "chi2_token",
    "chi2_seq",
    "rollout_probs_diff_mean",
    "rollout_probs_diff_max",
    "rollout_actor_probs_pearson_corr",
    "zero_advantage_groups",
    "zero_advantage_group_fraction",
    "dropped_groups",
    "extra_groups",
    "unfilled_groups",
    "truncated_fraction",
    "overlong_penalty",
    "loss",
    "entropy_bonus",
    "kl_ref",
    "kl_loss",
    "grad_norm",
    "skipped_optimizer_steps",
    "learning_rate",
    "publish_gather_seconds",
    "publish_wait_seconds",
    "publish_seconds",
    "learn_seconds",
    "rollout_wait_seconds",
    "tokens_generated_per_second",
    "tokens_learned_per_second",
    "spanning_sequences",
    "actor_busy_fraction",
)
"""Every step's metrics, in metrics.jsonl and as Prometheus gauges ``lockstep_trainer_<name>`` (the rollout
correction's and the mismatch's under the names verl uses, docs/corrections.md). What a publish
costs the trainer: ``publish_gather_seconds``, the gather of the full weights from the shards (a collective);
``publish_wait_seconds``, how long rank 0 waited for the previous version's publish since it handed that one over
(before a checkpoint, before this one, or until the actors could serve it, spec.trainer.maxLag); and, off the
trainer's path, ``publish_seconds``, the background write, hash, flush and rename of this version. Where the rest
of the step went (lockstep_workers.rollout.producer): ``learn_seconds``, learning; ``rollout_wait_seconds``, waiting for
the step's groups; the tokens the actors generated and the step learned per second since the previous step; how
many learned sequences span weights versions; and ``actor_busy_fraction``, the actors' mean share of that time with
a request in progress, by their own count (only when they report it). With dynamic sampling
(spec.trainer.rollout.dynamicSampling, and only then): ``dropped_groups``, ``extra_groups`` and ``unfilled_groups``
(lockstep_workers.rollout.producer.StepGroups). ``truncated_fraction``, the share of the step's completions cut at
maxTokens, and with spec.trainer.rollout.overlong's penalty ``overlong_penalty``, its mean
(lockstep_workers.trainer.shaping). ``skipped_optimizer_steps``: the step's optimiser steps skipped for a gradient norm
that is not finite (lockstep_workers.trainer.optimization.SkippedSteps)."""
GAUGES = {name: Gauge(f"lockstep_trainer_{name}", f"The last step's {name}.") for name in STEP_METRICS}
LAG_PREFIX, LAG_SUFFIX = "lag_", "_sequences"
"""A step's ``lag_<n>_sequences``: how many of its sequences' oldest tokens are n versions behind its weights."""
STALENESS = Histogram(
    "lockstep_trainer_sequence_staleness",
    "How many versions each learned sequence's oldest token is behind the weights it is learned with.",
    buckets=(0, 1, 2, 3, 4, 8, 16),
)
REWARD_PART_PREFIX = "rewards/"
"""A step's ``rewards/<name>``: one of spec.trainer.rewards' functions' own mean over the step's completions, before
its weight (also the gauge ``lockstep_trainer_reward_part{name="<name>"}``)."""
REWARD_PARTS = Gauge("lockstep_trainer_reward_part", "The last step's mean reward of each reward function.", ["name"])
EVAL_REWARD = "eval_reward"
"""The metric of the steps that evaluate first (spec.trainer.eval): the mean reward of greedy completions of the
eval split under the weights the step starts from (version step - 1)."""
EVAL_ROWS = "eval_rows"
"""How many eval rows that evaluation sampled."""
EVAL_GAUGE = Gauge(f"lockstep_trainer_{EVAL_REWARD}", "The last evaluation's mean reward (spec.trainer.eval).")
PUBLISHED = Gauge("lockstep_trainer_weights_version", "The newest weights version published and announced.")


@dataclass(frozen=True)
class PodEnvironment:
    """What the operator sets in a trainer pod's environment."""

    rank: int
    world_size: int
    actors: list[str]
    """Fixed actor URLs, outside a cluster; in a pod, ``actors_service`` says where the actors are listed."""
    shared_dir: Path | None
    """The job's directory for weights, checkpoints and metrics (on spec.weightSync.volume, or an emptyDir)."""
    config: PodConfig | None
    """The job's configuration ($LOCKSTEP_CONFIG); none outside an RLJob's pod."""
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
    local_rank: int = 0
    """Which of the pod's GPUs this rank uses."""
    actors_service: str | None = None
    """The job's actor Service, whose EndpointSlices list the actors."""
    job: str | None = None
    """The RLJob's name; none outside an RLJob's pod."""

    @property
    def weights_dir(self) -> Path:
        assert self.shared_dir is not None
        return weights_directory(self.shared_dir)

    @property
    def checkpoints_dir(self) -> Path:
        assert self.shared_dir is not None
        return checkpoints_directory(self.shared_dir)

    @property
    def metrics_file(self) -> Path:
        assert self.shared_dir is not None
        return self.shared_dir / "metrics.jsonl"

    @property
    def rollouts_file(self) -> Path:
        assert self.shared_dir is not None
        return self.shared_dir / "rollouts.jsonl"

    @property
    def rendezvous(self) -> str:
        return f"{self.weights_host}:{self.weights_group_port}"

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> PodEnvironment:
        return cls(
            rank=int(environ.get(environment.RANK, "0")),
            world_size=int(environ.get(environment.WORLD_SIZE, "1")),
            actors=[url.rstrip("/") for url in environ.get(environment.ACTORS_URL, "").split(",") if url],
            shared_dir=Path(environ[environment.SHARED_DIR]) if environment.SHARED_DIR in environ else None,
            config=load_pod_config(environ),
            pod=environ.get(environment.POD_NAME),
            namespace=environ.get(environment.POD_NAMESPACE),
            metrics_port=int(environ.get(environment.METRICS_PORT, "0")),
            weight_sync=WeightSyncBackend(environ.get(environment.WEIGHT_SYNC, WeightSyncBackend.FILESYSTEM)),
            weights_host=environ.get(environment.WEIGHTS_HOST, "127.0.0.1"),
            weights_port=int(environ.get(environment.WEIGHTS_PORT, "0")),
            weights_group_port=int(environ.get(environment.WEIGHTS_GROUP_PORT, "0")),
            local_rank=int(environ.get(environment.LOCAL_RANK, "0")),
            actors_service=environ.get(environment.ACTORS_SERVICE) or None,
            job=environ.get(environment.JOB),
        )


def announce(
    weights: Weights,
    namespace: str,
    pod: str,
    mismatch: Mismatch | None = None,
    evaluation: EvalResult | None = None,
) -> None:
    """Write ``lockstep.dev/weights`` and, when the step measured them, its ``lockstep.dev/mismatch`` and
    ``lockstep.dev/evaluation`` on this trainer pod (the only place the operator reads them from)."""
    annotations = {keys.WEIGHTS: document(weights)}
    if mismatch is not None:
        annotations[keys.MISMATCH] = document(mismatch)
    if evaluation is not None:
        annotations[keys.EVALUATION] = document(evaluation)
    _annotate(namespace, pod, annotations)


def report_output(output: OutputResult, namespace: str, pod: str) -> None:
    """Write ``lockstep.dev/output`` on this trainer pod: the model it wrote last (spec.output)."""
    _annotate(namespace, pod, {keys.OUTPUT: document(output)})


def _annotate(namespace: str, pod: str, annotations: Mapping[str, str]) -> None:
    """Merge ``annotations`` into this trainer pod's own."""
    from lockstep_workers.agent.pod_agent import pod_api

    pod_api().patch_namespaced_pod(pod, namespace, {"metadata": {"annotations": dict(annotations)}})


def step_reports(step: int, metrics: Mapping[str, float]) -> tuple[Mismatch | None, EvalResult | None]:
    """What trainer rank 0 reports of ``step`` (lockstep.dev/mismatch, lockstep.dev/evaluation), from its metrics,
    never a number the wire documents refuse: no mismatch for a step that measured none (no token sampled under the
    trainer's weights); a budget metric that is not finite is left out; a mismatch whose
    on-policy measurement, or an evaluation whose reward, is not finite is not reported (each logged)."""
    finite = {name: value for name, value in metrics.items() if math.isfinite(value)}
    left_out = sorted(name.value for name in BudgetMetric if name.value in metrics and name.value not in finite)
    if left_out:
        logger.warning("step %d: metrics %s are not finite and are left out of its report", step, ", ".join(left_out))
    mismatch = None
    if ONPOLICY_MISMATCH not in metrics:
        pass  # measured nothing: no report, the operator keeps the last measurement (status.mismatch.step says which)
    elif ONPOLICY_MISMATCH in finite and "onpolicy_token_fraction" in finite:
        mismatch = Mismatch(
            step=step,
            mean_abs_logprob_diff=finite[ONPOLICY_MISMATCH],
            token_fraction=finite["onpolicy_token_fraction"],
            stale_samples_dropped=int(finite.get("stale_samples_dropped", 0)),
            metrics={name.value: finite[name.value] for name in BudgetMetric if name.value in finite},
        )
    else:
        logger.warning("step %d: its on-policy mismatch is not finite; no mismatch is reported for it", step)
    evaluation = None
    if EVAL_REWARD in finite:
        evaluation = EvalResult(version=step - 1, reward=finite[EVAL_REWARD], rows=int(metrics[EVAL_ROWS]))
    elif EVAL_REWARD in metrics:
        logger.warning(
            "step %d: its eval reward %s is not finite; no evaluation is reported", step, metrics[EVAL_REWARD]
        )
    return mismatch, evaluation


def committed_weights(env: PodEnvironment) -> Weights | None:
    """The job's committed weights, as the operator recorded them on this pod (none outside a cluster)."""
    if not (env.pod and env.namespace):
        return None
    from lockstep_workers.agent.pod_agent import initial_weights, pod_api

    return initial_weights(pod_api(), env.namespace, env.pod)


def record(
    env: PodEnvironment,
    step: int,
    seconds: float,
    metrics: Mapping[str, float],
    tracking: Runs | None = None,
) -> None:
    """Append the step to metrics.jsonl (and log the same line to the ``tracking`` runs, spec.trainer.tracking) and set
    its gauges; the on-policy mismatch of a step that measured none is null there (left out of TensorBoard) and NaN
    in its gauge, and so are an MoE step's routing metrics that measured nothing (lockstep_workers.trainer.routing)."""
    line = {
        "step": step,
        "version": step,
        "seconds": round(seconds, 3),
        ONPOLICY_MISMATCH: None,
        **routing.unmeasured(metrics),
        **metrics,
    }
    with env.metrics_file.open("a") as stream:
        stream.write(json.dumps(line) + "\n")
    if tracking is not None:
        tracking.log(step, line)
    for name, gauge in GAUGES.items():
        if name in metrics:
            gauge.set(metrics[name])
    if ONPOLICY_MISMATCH not in metrics:  # measured nothing: NaN, Prometheus' "no value", not the last step's
        GAUGES[ONPOLICY_MISMATCH].set(math.nan)
    for name, value in metrics.items():
        if name.startswith(LAG_PREFIX) and name.endswith(LAG_SUFFIX):
            for _ in range(int(value)):
                STALENESS.observe(int(name.removeprefix(LAG_PREFIX).removesuffix(LAG_SUFFIX)))
        if name.startswith(REWARD_PART_PREFIX):
            REWARD_PARTS.labels(name=name.removeprefix(REWARD_PART_PREFIX)).set(value)
    if EVAL_REWARD in metrics:
        EVAL_GAUGE.set(metrics[EVAL_REWARD])
    PUBLISHED.set(step)


def record_rollouts(env: PodEnvironment, step: int, samples: Sequence[RewardInput], rewards: Sequence[float]) -> None:
    """Append the step's completions to rollouts.jsonl, each with its prompt's text, dataset row and reward."""
    with env.rollouts_file.open("a") as stream:
        for sample, reward in zip(samples, rewards, strict=True):
            line = {"step": step, "prompt": sample.prompt, "completion": sample.completion, "reward": reward}
            stream.write(json.dumps({**line, "row": sample.row}, default=str) + "\n")


class Sending:
    """Collective backends, rank 0: serve the manifests, and send each version as a member of its barrier
    (an agent thread acts on the commands the operator writes on this pod) until ``close``."""

    AGENT_WATCH_SECONDS = 5
    """How long the agent's watch runs before it checks whether to stop (so ``close`` returns soon)."""
    FINAL_ACK_SECONDS = 60.0
    """How long ``close`` waits for this pod's part in the last barrier."""

    def __init__(self, env: PodEnvironment) -> None:
        from lockstep_workers.agent.core import AgentCore
        from lockstep_workers.agent.pod_agent import PodAgent, pod_api

        self.server = ManifestServer(env.weights_dir, env.weights_port, env.rendezvous)
        self.stop = threading.Event()
        self.agent: threading.Thread | None = None
        self.sender: AgentCore | None = None
        if env.pod and env.namespace:
            self.sender = AgentCore(Sender(env.weights_dir, env.rendezvous, env.weight_sync))
            agent = PodAgent(self.sender, pod_api(), env.namespace, env.pod)
            self.agent = threading.Thread(
                target=agent.run, args=(self.stop, self.AGENT_WATCH_SECONDS), name="barrier-agent", daemon=True
            )
            self.agent.start()

    def close(self, final: int | None = None) -> None:
        """Stop the agent between two API calls (never in the middle of one) and the manifest server. With
        ``final``, first wait (up to FINAL_ACK_SECONDS) until this pod has resumed that version: its ack completes
        the last barrier with this pod among its members."""
        deadline = time.monotonic() + self.FINAL_ACK_SECONDS
        while final is not None and self.sender is not None and not self.sender.resumed(final):
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        self.stop.set()
        if self.agent is not None:
            self.agent.join(timeout=3 * self.AGENT_WATCH_SECONDS)
        self.server.close()
