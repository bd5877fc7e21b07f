"""The lockstep.dev/v1alpha1 API: RLJob and ParityPolicy.

These pydantic models are the one source of truth: the CRD YAML in crds/ is
generated from them (``python -m lockstep.crds``) and a test checks the two agree.
CEL rules that the API server enforces live beside the fields they guard.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

GROUP = "lockstep.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
RLJOBS = "rljobs"
PARITY_POLICIES = "paritypolicies"


def cel(rule: str, message: str, *, field_path: str | None = None, reason: str | None = None) -> dict[str, str]:
    """One x-kubernetes-validations entry."""
    entry = {"rule": rule, "message": message}
    if field_path:
        entry["fieldPath"] = field_path
    if reason:
        entry["reason"] = reason
    return entry


def validations(*rules: dict[str, str]) -> dict[str, Any]:
    return {"x-kubernetes-validations": list(rules)}


def immutable(field: str, why: str) -> dict[str, Any]:
    return validations(cel("self == oldSelf", f"{field} is immutable while the RLJob exists: {why}"))


OPAQUE_OBJECT: dict[str, Any] = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
OPAQUE_LIST: dict[str, Any] = {"type": "array", "items": OPAQUE_OBJECT}
"""Kubernetes core types passed through to pods as they are (validated by the API server on the pod)."""


class Model(BaseModel):
    """camelCase on the wire, snake_case in Python; unknown fields are errors."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


# -- vLLM settings -------------------------------------------------------------------


class LogprobsMode(StrEnum):
    RAW_LOGPROBS = "raw_logprobs"
    RAW_LOGITS = "raw_logits"
    PROCESSED_LOGPROBS = "processed_logprobs"
    PROCESSED_LOGITS = "processed_logits"


class DType(StrEnum):
    AUTO = "auto"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    FLOAT32 = "float32"


class VllmSettings(Model):
    """vLLM V1 engine arguments, by their CLI names in camelCase (``maxModelLen`` is ``--max-model-len``).

    A user sets them on ``spec.actors.vllm``; an admin locks them on ``ParityPolicy.spec.vllm``.
    Unset means "vLLM's default".
    """

    logprobs_mode: LogprobsMode | None = Field(
        None, description="Which logprobs vLLM returns; the trainer needs processed_logprobs."
    )
    enable_prefix_caching: bool | None = Field(None, description="V1 default: on.")
    async_scheduling: bool | None = Field(None, description="V1 default: on.")
    disable_cascade_attn: bool | None = Field(
        None, description="Cascade attention is chosen by heuristic unless disabled."
    )
    hf_overrides: dict[str, str | int | float | bool] | None = Field(
        None, description='Overrides of the Hugging Face config, e.g. {"head_dtype": "float32"} for an fp32 lm_head.'
    )
    dtype: DType | None = None
    max_model_len: Annotated[int, Field(ge=1)] | None = None
    max_num_seqs: Annotated[int, Field(ge=1)] | None = None
    max_num_batched_tokens: Annotated[int, Field(ge=1)] | None = None
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] | None = None
    tensor_parallel_size: Annotated[int, Field(ge=1)] | None = None
    enforce_eager: bool | None = None
    enable_chunked_prefill: bool | None = None
    seed: int | None = None


# -- ParityPolicy --------------------------------------------------------------------


class Enforcement(StrEnum):
    ENFORCE = "Enforce"
    WARN = "Warn"
    AUDIT = "Audit"


class PauseMode(StrEnum):
    KEEP = "keep"
    ABORT = "abort"
    WAIT = "wait"


class BudgetAction(StrEnum):
    WARN = "Warn"
    PAUSE = "Pause"


class MismatchBudget(Model):
    mean_abs_logprob_diff: Annotated[float, Field(gt=0)] = Field(
        0.02,
        description="Largest mean |logprob_trainer - logprob_rollout| tolerated on tokens sampled under the "
        "trainer's current weights (numerics only: stale tokens from in-flight updates are not counted).",
    )
    on_exceeded: BudgetAction = Field(
        BudgetAction.WARN,
        description="Warn: condition ParityDegraded and a Warning event. Pause: also hold weight updates (the "
        "actors keep serving the last committed weights and the trainer waits, within spec.trainer.maxLag) "
        "until the trainer's last measurement is within the budget again, e.g. after the budget is raised.",
    )


class TrainerParity(Model):
    lm_head_dtype: DType = Field(DType.FLOAT32, description="dtype of the trainer's final projection.")
    mismatch_budget: MismatchBudget = Field(default_factory=MismatchBudget)


class WeightUpdateSemantics(Model):
    pause_mode: PauseMode = Field(
        PauseMode.KEEP, description="keep: in-flight requests stay and resume under the new weights."
    )
    clear_cache: bool = Field(False, description="Whether the KV (prefix) cache is dropped on a weight update.")


class NamespaceSelector(Model):
    match_labels: dict[str, str] = Field(default_factory=dict, description="Empty selects every namespace.")


PREFIX_CACHE_RULE = cel(
    "self.weightUpdate.clearCache || (has(self.vllm.enablePrefixCaching) && !self.vllm.enablePrefixCaching)",
    "incoherent policy: weightUpdate.clearCache=false requires vllm.enablePrefixCaching: false, because with prefix "
    "caching on, requests after a weight update reuse KV cache computed under the old weights (measured: logprobs "
    "off by tens of nats). Set vllm.enablePrefixCaching: false, or weightUpdate.clearCache: true",
    field_path=".vllm.enablePrefixCaching",
    reason="FieldValueInvalid",
)


class ParityPolicySpec(Model):
    model_config = ConfigDict(json_schema_extra=validations(PREFIX_CACHE_RULE))

    default: bool = Field(False, description="Used by RLJobs that name no policy. Exactly one policy should set it.")
    enforcement: Enforcement = Field(
        Enforcement.ENFORCE,
        description="Enforce: jobs that set a locked key otherwise are refused. Warn: they run with the locked "
        "value and a warning. Audit: only recorded.",
    )
    namespace_selector: NamespaceSelector = Field(
        default_factory=NamespaceSelector, description="The namespaces whose RLJobs this policy applies to."
    )
    vllm: VllmSettings = Field(default_factory=VllmSettings, description="Locked vLLM settings.")
    trainer: TrainerParity = Field(default_factory=TrainerParity)
    weight_update: WeightUpdateSemantics = Field(default_factory=WeightUpdateSemantics)


class ParityPolicy(Model):
    api_version: str = API_VERSION
    kind: str = "ParityPolicy"
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: ParityPolicySpec


# -- RLJob ---------------------------------------------------------------------------


class ModelSource(Model):
    uri: Annotated[str, Field(min_length=1)] = Field(description="Path in the pod, or a URI, of the base model.")
    dtype: DType = DType.BFLOAT16


class PodOverrides(Model):
    """Kubernetes pod fields passed through to the pods of one role."""

    resources: dict[str, Any] | None = Field(None, json_schema_extra=OPAQUE_OBJECT)
    node_selector: dict[str, str] | None = None
    tolerations: list[dict[str, Any]] | None = Field(None, json_schema_extra=OPAQUE_LIST)
    affinity: dict[str, Any] | None = Field(None, json_schema_extra=OPAQUE_OBJECT)
    env: list[dict[str, Any]] | None = Field(None, json_schema_extra=OPAQUE_LIST)
    volumes: list[dict[str, Any]] | None = Field(None, json_schema_extra=OPAQUE_LIST)
    volume_mounts: list[dict[str, Any]] | None = Field(None, json_schema_extra=OPAQUE_LIST)


class ActorSpec(PodOverrides):
    replicas: Annotated[int, Field(ge=0, le=4096)] = 1
    image: Annotated[str, Field(min_length=1)]
    vllm: VllmSettings = Field(default_factory=VllmSettings, description="vLLM arguments for the rollout servers.")


class Algorithm(StrEnum):
    GSPO = "gspo"
    PPO = "ppo"
    GRPO = "grpo"


class TruncatedImportanceSampling(Model):
    enabled: bool = False
    cap: Annotated[float, Field(gt=1)] = Field(2.0, description="C in min(pi_train / pi_rollout, C).")


class Objective(Model):
    algorithm: Algorithm = Algorithm.GSPO
    clip_epsilon_low: Annotated[float, Field(gt=0, lt=1)] = 0.2
    clip_epsilon_high: Annotated[float, Field(gt=0)] = 0.28
    truncated_importance_sampling: TruncatedImportanceSampling = Field(default_factory=TruncatedImportanceSampling)
    learning_rate: Annotated[float, Field(gt=0, le=1)] = 1e-6
    minibatches: Annotated[int, Field(ge=1, le=64)] = Field(
        2,
        description="Optimiser steps per batch of rollouts, each on a slice of its prompt groups; ratios are "
        "taken against the weights the batch started from, so clipping acts from the second on.",
    )


CALLABLE_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$"
"""``package.module:function``: a Python callable importable in the trainer's image."""


class RolloutSettings(Model):
    prompts_per_step: Annotated[int, Field(ge=1, le=65536)] = Field(8, description="Prompts sampled per step.")
    samples_per_prompt: Annotated[int, Field(ge=2, le=1024)] = Field(
        8, description="Completions per prompt: a group, whose mean reward is the baseline (GRPO/GSPO)."
    )
    max_tokens: Annotated[int, Field(ge=1)] = Field(16, description="Longest completion, in tokens.")
    temperature: Annotated[float, Field(gt=0)] = Field(
        1.0, description="Sampling temperature; the trainer applies the same one to its logprobs."
    )
    top_p: Annotated[float, Field(gt=0, le=1)] = Field(
        1.0,
        description="Nucleus sampling; the trainer applies vLLM's exact top-p mask to its logprobs, and leaves "
        "out of the loss the few tokens that fall outside its own set (counted as outside_top_p_fraction).",
    )


class Training(Model):
    """What the trainer process runs: the operator passes these fields to it as they are (--settings)."""

    reward: str = Field(
        pattern=CALLABLE_PATTERN,
        description="The reward function, package.module:function, called as reward(prompt_token_ids, "
        "completion_token_ids) -> float; e.g. lockstep_workers.rewards:target_words.",
    )
    prompts: str = Field(
        "lockstep_workers.rewards:random_prompts",
        pattern=CALLABLE_PATTERN,
        description="The prompt source, package.module:function, called as prompts(step, count, seed) -> "
        "list of prompt token id lists.",
    )
    steps: Annotated[int, Field(ge=1)] = Field(100, description="Optimiser steps; the job succeeds after the last.")
    max_lag: Annotated[int, Field(ge=0)] = Field(
        1,
        description="How many versions the actors may be behind when a step's sampling starts: 0 waits for each "
        "weight update to finish; 1 samples while the previous update is in flight.",
    )
    seed: int = 0
    rollout: RolloutSettings = Field(default_factory=RolloutSettings)
    objective: Objective = Field(default_factory=Objective)


TRAINER_SHARDS_RULE = cel(
    "self.rollout.promptsPerStep >= self.replicas * self.objective.minibatches",
    "spec.trainer.rollout.promptsPerStep must be at least spec.trainer.replicas times "
    "spec.trainer.objective.minibatches: each rank trains on whole prompt groups, in that many minibatches; "
    "raise promptsPerStep or lower the others",
    field_path=".rollout.promptsPerStep",
)


class TrainerSpec(PodOverrides, Training):
    model_config = ConfigDict(json_schema_extra=validations(TRAINER_SHARDS_RULE))

    replicas: Annotated[int, Field(ge=1, le=1024)] = Field(1, description="torch.distributed world size.")
    image: Annotated[str, Field(min_length=1)]

    def training(self) -> Training:
        return Training.model_validate(self.model_dump(include=set(Training.model_fields)))


class WeightSyncBackend(StrEnum):
    FILESYSTEM = "filesystem"
    NCCL = "nccl"
    GLOO = "gloo"

    @property
    def collective(self) -> bool:
        """True when the trainer sends the weights itself, as a member of every barrier."""
        return self is not WeightSyncBackend.FILESYSTEM


class TimeoutAction(StrEnum):
    FAIL_JOB = "FailJob"
    EVICT_STRAGGLER = "EvictStraggler"


WEIGHTS_VOLUME_RULE = cel(
    "self.backend != 'filesystem' || has(self.volume)",
    "spec.weightSync.volume is required with backend filesystem: a volume every actor and trainer pod mounts, "
    "where the trainer writes weights and the actors read them, e.g. {persistentVolumeClaim: {claimName: weights}} "
    "(ReadWriteMany), or {hostPath: {path: /var/lib/lockstep}} when every pod runs on one node",
    field_path=".volume",
    reason="FieldValueRequired",
)


class WeightSync(Model):
    model_config = ConfigDict(json_schema_extra=validations(WEIGHTS_VOLUME_RULE))

    backend: WeightSyncBackend = Field(
        WeightSyncBackend.FILESYSTEM,
        description="How weights reach the actors. filesystem: the trainer writes safetensors files on "
        "spec.weightSync.volume and the actors read them. nccl (GPUs) or gloo (CPUs, over TCP): trainer rank 0 sends "
        "them into the actors' vLLM workers through vLLM's weight-transfer engine, in a process group formed for "
        "each weight update.",
        json_schema_extra=immutable("spec.weightSync.backend", "the actors and trainer were started for it"),
    )
    volume: dict[str, Any] | None = Field(
        None,
        description="A Kubernetes volume source (without a name), mounted in the job's pods (with nccl or gloo, in "
        "the trainer's only): the trainer writes weights and metrics.jsonl under <mount>/<job uid>/. Required with "
        "backend filesystem; with nccl or gloo it is optional and keeps the trainer's checkpoints across trainer "
        "restarts (without it they live in an emptyDir, and a trainer that lost its pod after weights were "
        "committed cannot resume).",
        json_schema_extra=OPAQUE_OBJECT,
    )
    barrier_timeout_seconds: Annotated[int, Field(ge=1, le=86400)] = 600
    on_timeout: TimeoutAction = TimeoutAction.FAIL_JOB


class Preflight(Model):
    enabled: bool = Field(
        False,
        description="Before training, a pod of its own (<job>-preflight-0, the actors' image) samples with the "
        "job's effective vLLM configuration and recomputes the tokens with the trainer's forward pass; over the "
        "ParityPolicy's mismatch budget, the job stops (ParityLocked=False, MismatchBudgetExceeded).",
    )
    prompts: Annotated[int, Field(ge=1, le=1024)] = 8
    samples_per_prompt: Annotated[int, Field(ge=1, le=64)] = 4


RLJOB_NAME_MAX = 45
RLJOB_NAME_RULE = cel(
    f"size(self.metadata.name) <= {RLJOB_NAME_MAX}",
    f"metadata.name: at most {RLJOB_NAME_MAX} characters, so that pod host names <name>-trainer-<rank> stay "
    "valid DNS labels (63 characters); choose a shorter name",
)


class RLJobSpec(Model):
    model: ModelSource = Field(json_schema_extra=immutable("spec.model", "weights are trained from this base model"))
    parity_policy: Annotated[str, Field(min_length=1)] | None = Field(
        None, description="ParityPolicy to apply; default: the cluster's default policy."
    )
    actors: ActorSpec
    trainer: TrainerSpec
    weight_sync: WeightSync
    preflight: Preflight = Field(default_factory=Preflight)
    suspend: bool = False
    max_restarts: Annotated[int, Field(ge=0)] = 3
    ttl_seconds_after_finished: Annotated[int, Field(ge=0)] | None = None


# -- the weight-update barrier (docs/barrier-protocol.md) -------------------------------

PROTOCOL = 1
"""Version of the barrier protocol; every annotation document carries it."""


class BarrierPhase(StrEnum):
    PAUSE = "Pause"
    UPDATE = "Update"
    RESUME = "Resume"


class Weights(Model):
    """Published weights: ``lockstep.dev/weights`` (trainer) and ``lockstep.dev/initial-weights`` (operator)."""

    protocol: int = PROTOCOL
    version: Annotated[int, Field(ge=1)]
    uri: Annotated[str, Field(min_length=1)]
    digest: Annotated[str, Field(min_length=1)]


class TransferGroup(Model):
    """A member's place in the process group that carries one barrier's weights (collective backends): the
    trainer is rank 0; an actor's vLLM workers take ranks ``rankOffset`` to ``rankOffset + workers - 1``."""

    rank_offset: int = Field(ge=0)
    world_size: int = Field(ge=2)


class Command(Model):
    """``lockstep.dev/barrier``: what the operator asks a member pod to do."""

    protocol: int = PROTOCOL
    id: str
    version: int
    uri: str
    digest: str
    phase: BarrierPhase
    group: TransferGroup | None = Field(
        None, description="collective backends, Update phase: this member's rank in the transfer group"
    )


class Ack(Model):
    """``lockstep.dev/barrier-ack``: what a pod says it has done."""

    protocol: int = PROTOCOL
    id: str | None = None
    phase: str
    loaded_version: int | None = None
    digest: str | None = None
    error: str | None = None


class Mismatch(Model):
    """``lockstep.dev/mismatch``: the train-inference parity the trainer measured on its last step."""

    protocol: int = PROTOCOL
    step: int
    mean_abs_logprob_diff: float = Field(
        description="mean |logprob_trainer - logprob_rollout| on sequences sampled wholly under the trainer's weights"
    )
    token_fraction: float = Field(description="the fraction of the step's tokens that measurement covers")


class PreflightResult(Model):
    """``lockstep.dev/preflight``: what the preflight pod measured under the job's effective configuration."""

    protocol: int = PROTOCOL
    mean_abs_logprob_diff: float = Field(description="mean |logprob_trainer - logprob_rollout|, plain sampling")
    shared_prefix_mean_abs_logprob_diff: float = Field(
        description="the same, for requests that share a prompt with earlier ones, after an in-flight weight update"
    )
    clip_fraction: float = Field(description="tokens whose ratio leaves [1 - 0.2, 1 + 0.2]")
    outside_top_p_per_thousand: float = Field(description="tokens outside the trainer's top-p set, per 1000")
    tokens: int


class BarrierStatus(Model):
    """The open barrier, as recorded in ``RLJob.status.barrier``."""

    id: str
    version: int
    uri: str
    digest: str
    phase: BarrierPhase
    members: dict[str, str] = Field(description="pod name → pod UID")
    acked: list[str] = Field(default_factory=list, description="members that acked the current phase, in order")
    started_at: str
    phase_started_at: str
    deadline: str = Field(description="when the current phase times out")
    phase_seconds: dict[str, float] = Field(default_factory=dict)
    slowest: dict[str, str] = Field(default_factory=dict, description="phase → the last member to ack it")
    evicted: list[str] = Field(default_factory=list)
    reported: dict[str, str] = Field(default_factory=dict, description="pod → invalid ack already reported")
    transfer_ranks: dict[str, int] = Field(
        default_factory=dict,
        description="collective backends, from the Update phase on: member → its first rank in the transfer group",
    )
    transfer_world_size: int | None = None

    def weights(self) -> Weights:
        return Weights(version=self.version, uri=self.uri, digest=self.digest)

    def command(self, member: str) -> Command:
        """The command for ``member``: its rank in the transfer group, when it has one, in the Update phase."""
        group = None
        if self.phase is BarrierPhase.UPDATE and member in self.transfer_ranks and self.transfer_world_size:
            group = TransferGroup(rank_offset=self.transfer_ranks[member], world_size=self.transfer_world_size)
        return Command(
            id=self.id, version=self.version, uri=self.uri, digest=self.digest, phase=self.phase, group=group
        )


class BarrierOutcome(StrEnum):
    COMPLETED = "Completed"
    FAILED = "Failed"


class BarrierRecord(Model):
    """One finished barrier, kept in ``RLJob.status.barrierHistory``."""

    id: str
    version: int
    outcome: BarrierOutcome
    seconds: float
    phase_seconds: dict[str, float]
    slowest_pod: str | None = None
    members: int
    evicted: list[str] = Field(default_factory=list)


class ConditionStatus(StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class Condition(Model):
    """A metav1.Condition."""

    type: str
    status: ConditionStatus
    reason: str
    message: str = ""
    last_transition_time: str
    observed_generation: int | None = None


class Phase(StrEnum):
    PENDING = "Pending"
    RUNNING = "Running"
    SUSPENDED = "Suspended"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


class ReplicaStatus(Model):
    desired: int = 0
    ready: int = 0
    summary: str = Field("0/0", description="ready/desired, for kubectl get.")


class RLJobStatus(Model):
    phase: Phase = Phase.PENDING
    conditions: list[Condition] = Field(default_factory=list)
    observed_generation: int | None = None
    actors: ReplicaStatus = Field(default_factory=ReplicaStatus)
    trainer: ReplicaStatus = Field(default_factory=ReplicaStatus)
    weights_version: int | None = Field(None, description="The version every member serves (last barrier).")
    weights: Weights | None = Field(None, description="The committed weights; new pods start from them.")
    lag: int | None = Field(None, description="Newest announced version minus the oldest version an actor serves.")
    barrier: BarrierStatus | None = Field(None, description="The weight update in flight.")
    barrier_history: list[BarrierRecord] = Field(default_factory=list, description="The most recent barriers.")
    mismatch: Mismatch | None = Field(None, description="The trainer's last parity measurement.")
    preflight: PreflightResult | None = Field(None, description="The preflight parity check's result.")
    config_fingerprint: str | None = None
    parity_policy: str | None = Field(None, description="The ParityPolicy that was applied.")
    restarts: int = 0
    last_restart_time: str | None = None
    finished_time: str | None = None


class RLJob(Model):
    api_version: str = API_VERSION
    kind: str = "RLJob"
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: RLJobSpec
    status: RLJobStatus | None = None
