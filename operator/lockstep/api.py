"""The lockstep.dev/v1alpha1 API: RLJob and ParityPolicy.

These pydantic models are the one source of truth: the CRD YAML in crds/ is
generated from them (``python -m lockstep.crds``) and a test checks the two agree.
CEL rules that the API server enforces live beside the fields they guard.
"""

from __future__ import annotations

import math
from enum import StrEnum
from typing import Annotated, Any

from pydantic import BeforeValidator, ConfigDict, Field, WithJsonSchema

from lockstep import environment
from lockstep.protocol import (
    BarrierPhase,
    Command,
    EvalResult,
    Mismatch,
    OutputResult,
    PreflightResult,
    TransferGroup,
    Weights,
)
from lockstep.schema import OPAQUE_LIST, OPAQUE_OBJECT, Model

GROUP = "lockstep.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
RLJOBS = "rljobs"
PARITY_POLICIES = "paritypolicies"


def cel(
    rule: str,
    message: str,
    *,
    field_path: str | None = None,
    reason: str | None = None,
    message_expression: str | None = None,
) -> dict[str, str]:
    """One x-kubernetes-validations entry (``message_expression``: CEL that words the message from ``self``;
    ``message`` is the API server's fallback when that fails)."""
    entry = {"rule": rule, "message": message}
    if message_expression:
        entry["messageExpression"] = message_expression
    if field_path:
        entry["fieldPath"] = field_path
    if reason:
        entry["reason"] = reason
    return entry


def validations(*rules: dict[str, str]) -> dict[str, Any]:
    return {"x-kubernetes-validations": list(rules)}


def immutable(field: str, why: str) -> dict[str, Any]:
    return validations(cel("self == oldSelf", f"{field} is immutable while the RLJob exists: {why}"))


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
    dtype: DType | None = Field(
        None,
        description="Data type of the weights and activations (--dtype); auto: the checkpoint's. vLLM's default: auto.",
    )
    max_model_len: Annotated[int, Field(ge=1)] | None = Field(
        None,
        description="Longest sequence, prompt and completion, in tokens. vLLM's default: the model's context length.",
    )
    max_num_seqs: Annotated[int, Field(ge=1)] | None = Field(
        None, description="Most sequences in one engine step (a batch). vLLM's default depends on the hardware."
    )
    max_num_batched_tokens: Annotated[int, Field(ge=1)] | None = Field(
        None, description="Most tokens in one engine step, in tokens. vLLM's default depends on the hardware."
    )
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] | None = Field(
        None,
        description="Fraction (0-1] of the accelerator's memory vLLM may take for the weights, activations and "
        "KV cache. vLLM's default: 0.9.",
    )
    tensor_parallel_size: Annotated[int, Field(ge=1)] | None = Field(
        None, description="GPUs each actor shards the model over (its vLLM workers). vLLM's default: 1."
    )
    enforce_eager: bool | None = Field(
        None, description="Run the model eagerly, without CUDA graphs or torch.compile. vLLM's default: false."
    )
    enable_chunked_prefill: bool | None = Field(
        None, description="Split long prompts' prefill across engine steps. vLLM's default: on in V1."
    )
    seed: int | None = Field(None, description="Seed of vLLM's random sampling. vLLM's default: 0.")


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
    FAIL = "Fail"


class BudgetMetric(StrEnum):
    """The step metrics a mismatch budget may name (docs/corrections.md): the trainer announces those it measured
    with each step's lockstep.dev/mismatch, and the operator shows them in status.mismatch.metrics. One a step did
    not measure (routing_mismatch without engine routings, the MoE ones of a dense model) is not announced, and its
    limit is neither met nor exceeded: ParityDegraded says it was not measured."""

    ESS = "ess"
    ROLLOUT_IS_EFF_SAMPLE_SIZE = "rollout_is_eff_sample_size"
    ROLLOUT_IS_MEAN = "rollout_is_mean"
    ROLLOUT_IS_RATIO_FRACTION_HIGH = "rollout_is_ratio_fraction_high"
    ROLLOUT_IS_RATIO_FRACTION_LOW = "rollout_is_ratio_fraction_low"
    ROLLOUT_IS_MASKED_FRACTION = "rollout_is_masked_fraction"
    ROLLOUT_IS_VETO_FRACTION = "rollout_is_veto_fraction"
    TRAINING_PPL = "training_ppl"
    ROLLOUT_PPL = "rollout_ppl"
    LOG_PPL_DIFF = "log_ppl_diff"
    K3_KL = "k3_kl"
    CHI2_TOKEN = "chi2_token"
    CHI2_SEQ = "chi2_seq"
    ROLLOUT_PROBS_DIFF_MEAN = "rollout_probs_diff_mean"
    ROLLOUT_PROBS_DIFF_MAX = "rollout_probs_diff_max"
    ROLLOUT_ACTOR_PROBS_PEARSON_CORR = "rollout_actor_probs_pearson_corr"
    MEAN_ABS_LOGPROB_DIFF = "mean_abs_logprob_diff"
    KL_NEW_OLD = "kl_new_old"
    CLAMP_LOG_RATIO_NEW_OLD_INDICATOR = "clamp_log_ratio_new_old_indicator"
    OUTSIDE_TOP_P_FRACTION = "outside_top_p_fraction"
    ZERO_ADVANTAGE_GROUP_FRACTION = "zero_advantage_group_fraction"
    ROUTING_MISMATCH = "routing_mismatch"
    EXPERT_LOAD_IMBALANCE = "expert_load_imbalance"


METRIC_LIMIT_RULE = cel(
    "has(self.min) || has(self.max)",
    "a mismatch budget limit needs min (exceeded below it), max (exceeded above it) or both (|x| <= 0.1: min -0.1, "
    "max 0.1)",
    field_path=".max",
    reason="FieldValueRequired",
)
METRIC_LIMIT_ORDER_RULE = cel(
    "!has(self.min) || !has(self.max) || self.min <= self.max",
    "a mismatch budget limit's min is above its max, so every value exceeds it: swap them",
    field_path=".min",
    reason="FieldValueInvalid",
)


class MetricLimit(Model):
    """One limit of the mismatch budget: a step whose metric is below min or above max exceeds it."""

    model_config = ConfigDict(json_schema_extra=validations(METRIC_LIMIT_RULE, METRIC_LIMIT_ORDER_RULE))

    metric: BudgetMetric = Field(description="The step metric held to the limit (docs/corrections.md).")
    min: float | None = Field(None, description="The least value within the budget, e.g. 0.3 for an ESS.")
    max: float | None = Field(None, description="The largest value within the budget, e.g. 0.1 for k3_kl.")


class MismatchBudget(Model):
    mean_abs_logprob_diff: Annotated[float, Field(gt=0)] = Field(
        0.1,
        description="Largest mean |logprob_trainer - logprob_rollout| tolerated on tokens sampled under the "
        "trainer's current weights (numerics only: stale tokens from in-flight updates are not counted), in the "
        "preflight and on every step. The default passes a sound bf16 job on a real model (SmolLM2-135M-Instruct: "
        "0.03-0.04) and fails raw logprobs at temperature 0.7 (0.47), a reused KV cache and a stale head (2 or "
        "more); fp32 on both sides leaves under 1e-4 (docs/parity.md). After an in-flight update the preflight "
        "also tolerates up to 10x its plain sampling's mismatch.",
    )
    limits: list[MetricLimit] = Field(
        default_factory=list,
        max_length=32,
        description="More limits, on the step metrics the trainer announces (ESS, k3_kl, the masked fraction, "
        "an MoE model's routing_mismatch, ...): each trainer step is held to every one, as to meanAbsLogprobDiff; "
        "a limit whose metric the step did not measure is not held (ParityDegraded names it as not measured).",
    )
    on_exceeded: BudgetAction = Field(
        BudgetAction.WARN,
        description="Warn: condition ParityDegraded and a Warning event. Pause: also hold weight updates (the "
        "actors keep serving the last committed weights and the trainer waits, within spec.trainer.maxLag) "
        "until the trainer's last measurement is within the budget again, e.g. after the budget is raised. Fail: "
        "the job fails (phase Failed, reason MismatchBudgetExceeded, the breach named) and its pods stop; an open "
        "weight update is interrupted, so the committed weights are the last within the budget.",
    )


class TrainerNumerics(Model):
    """What the trainer computes like the actors (part of a job's config fingerprint)."""

    lm_head_dtype: DType = Field(DType.FLOAT32, description="dtype of the trainer's final projection.")


class TrainerParity(TrainerNumerics):
    mismatch_budget: MismatchBudget = Field(
        default_factory=MismatchBudget,
        description="The train-inference mismatch a job may show, in its preflight and on every step, and what "
        "happens beyond it.",
    )


class WeightUpdateSemantics(Model):
    pause_mode: PauseMode = Field(
        PauseMode.KEEP, description="keep: in-flight requests stay and resume under the new weights."
    )
    clear_cache: bool = Field(False, description="Whether the KV (prefix) cache is dropped on a weight update.")


class Requirement(StrEnum):
    """Whether the jobs a ParityPolicy governs may, must or must not use a feature: a LoRA adapter
    (spec.trainer.lora), routing replay (spec.actors.routingReplay)."""

    ALLOWED = "Allowed"
    REQUIRED = "Required"
    FORBIDDEN = "Forbidden"


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


REPLAY_PREFIX_CACHE_RULE = cel(
    "self.routingReplay != 'Required' || (has(self.vllm.enablePrefixCaching) && self.vllm.enablePrefixCaching && "
    "self.weightUpdate.clearCache)",
    "incoherent policy: routingReplay Required turns prefix caching on in every job it governs (vLLM returns the "
    "routed experts only with prefix caching), and a weight update must then clear the cache, or requests reuse KV "
    "computed under the old weights. Set vllm.enablePrefixCaching: true and weightUpdate.clearCache: true, or "
    "routingReplay: Allowed",
    field_path=".routingReplay",
    reason="FieldValueInvalid",
)
"""A Required policy states what its jobs run with: the effective configuration of a replaying job has prefix
caching on and clearCache true (lockstep.parity.effective_config)."""


class ParityPolicySpec(Model):
    """The vLLM settings a cluster admin locks for the RLJobs of the selected namespaces, and how strictly."""

    model_config = ConfigDict(json_schema_extra=validations(PREFIX_CACHE_RULE, REPLAY_PREFIX_CACHE_RULE))

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
    trainer: TrainerParity = Field(
        default_factory=TrainerParity, description="What the trainer must do to match the actors' numerics."
    )
    weight_update: WeightUpdateSemantics = Field(
        default_factory=WeightUpdateSemantics,
        description="How an actor takes new weights mid-generation (vLLM's pause_generation arguments).",
    )
    lora: Requirement = Field(
        Requirement.ALLOWED,
        description="Whether the jobs may train a LoRA adapter (spec.trainer.lora) instead of every weight. Allowed: "
        "either. Required: only LoRA jobs. Forbidden: only full fine-tuning. Under Enforce the API server and the "
        "operator refuse a job that breaks it; under Warn and Audit it runs as written, and its ParityLocked "
        "condition and a Warning event say that it breaks the policy (a job's adapter is never added or dropped).",
    )
    routing_replay: Requirement = Field(
        Requirement.ALLOWED,
        description="Whether the jobs' actors return the experts each token was routed to (vLLM's "
        "enable_return_routed_experts), for the trainer to replay in its routers (spec.actors.routingReplay; "
        "docs/parity.md#routing-replay-moe). Replay needs vLLM's prefix caching, so a replaying job runs with "
        "vllm.enablePrefixCaching true and weightUpdate.clearCache true whatever this policy locks. Allowed: each job "
        "chooses. Required: every job replays (this policy must then set vllm.enablePrefixCaching: true and "
        "weightUpdate.clearCache: true), and under Enforce a job that cannot (pipeline parallelism) is refused. "
        "Forbidden: under Enforce the API server and the operator refuse a job that asks for it; under Warn and Audit "
        "it runs as written, and its ParityLocked condition and a Warning event say so.",
    )


class ParityPolicy(Model):
    api_version: str = API_VERSION
    kind: str = "ParityPolicy"
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: ParityPolicySpec


# -- RLJob ---------------------------------------------------------------------------


class ModelSource(Model):
    uri: Annotated[str, Field(min_length=1)] = Field(description="Path in the pod, or a URI, of the base model.")
    dtype: DType = Field(
        DType.BFLOAT16,
        description="The dtype the trainer computes the model's layers in (auto: the checkpoint's). Keep "
        "spec.actors.vllm.dtype the same, so that both sides compute alike.",
    )


QUANTITY_PATTERN = r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$"
"""A Kubernetes resource quantity (the API server's own pattern): 500m, 2, 16Gi, 1e3."""
Quantity = Annotated[
    str,
    BeforeValidator(lambda value: str(value) if type(value) is int else value),
    Field(pattern=QUANTITY_PATTERN),
    WithJsonSchema({"anyOf": [{"type": "integer"}, {"type": "string", "pattern": QUANTITY_PATTERN}]}),
]
ENV_NAME_PATTERN = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"


def _cel_strings(items: tuple[str, ...]) -> str:
    return "[" + ", ".join(f"'{item}'" for item in items) + "]"


RESERVED_ENV_RULE = cel(
    f"!self.startsWith('{environment.RESERVED_PREFIX}') && !(self in {_cel_strings(environment.RESERVED_NAMES)})",
    "the Lockstep operator sets this variable itself; remove it from env",
    message_expression=f"self + '{environment.RESERVED_ENV_WHY}'",
)
"""The job's env may not take over a variable the operator sets (``environment.reserved_env``)."""
LOCKED_ENV_RULE = cel(
    f"!(self.startsWith('{environment.VLLM_PREFIX}') && !(self in {_cel_strings(environment.ALLOWED_VLLM_ENV)})) "
    f"&& !(self in {_cel_strings(environment.CODE_PATH_NAMES)})",
    "this variable would change what vLLM computes or the code the image runs, behind the lock of the ParityPolicy; "
    "remove it from env",
    message_expression=f"self + '{environment.LOCKED_ENV_WHY}'",
)
"""The job's env may not change vLLM's numerics or the code a worker runs (``environment.locked_env``)."""
CREDENTIAL_ENV_RULE = cel(
    f"!(self.name in {_cel_strings(environment.CREDENTIAL_NAMES)}) || !has(self.value)",
    "this variable is a credential: take it from a Secret (valueFrom.secretKeyRef), never inline",
    field_path=".value",
    message_expression=f"self.name + '{environment.CREDENTIAL_WHY}'",
)
"""An experiment tracker's credential comes from a Secret (``environment.CREDENTIAL_NAMES``)."""


def _reserved_mount_cel() -> str:
    """CEL: ``environment.reserved_mount(self)``."""
    absolute = "(self.startsWith('/') ? self : '/' + self)"
    unclean = [f"{absolute}.contains('{part}')" for part in environment.UNCLEAN_PATH_PARTS]
    unclean += [f"{absolute}.endsWith('{ending}')" for ending in environment.UNCLEAN_PATH_ENDINGS]
    under = [f"{absolute} == '{root}' || {absolute}.startsWith('{root}/')" for root in environment.RESERVED_MOUNTS]
    return " || ".join(unclean + under)


RESERVED_MOUNT_RULE = cel(
    f"!({_reserved_mount_cel()})",
    "the Lockstep operator mounts this path itself, or it is not written plainly; mount elsewhere",
    message_expression=f"'mountPath ' + self + '{environment.RESERVED_MOUNT_WHY}'",
)
"""The job's volumeMounts may not cover the operator's own mounts (``environment.reserved_mount``)."""
RESERVED_VOLUME_RULE = cel(
    f"!self.startsWith('{environment.RESERVED_VOLUME_PREFIX}')",
    f"volume names starting with {environment.RESERVED_VOLUME_PREFIX} are the Lockstep operator's; rename the volume",
    message_expression=f"'volume ' + self + '{environment.RESERVED_VOLUME_WHY}'",
)
"""The job's volumes may not take an operator volume's name (``environment.reserved_volume``)."""
RESERVED_VOLUME_MOUNT_RULE = cel(
    f"!self.startsWith('{environment.RESERVED_VOLUME_PREFIX}')",
    f"volumes named {environment.RESERVED_VOLUME_PREFIX}* are the Lockstep operator's (lockstep-shared holds every "
    "job's weights); mount a volume of the job's own",
    message_expression=f"'volume ' + self + '{environment.RESERVED_VOLUME_MOUNT_WHY}'",
)
"""The job's volumeMounts may not mount an operator volume (``environment.reserved_volume``): the shared volume
whole, or another job's directory of it by subPath."""
MAX_PASSED_THROUGH = 128
"""The most volumes, volumeMounts or env entries a role may add: the API server needs bounds on the lists and
strings these rules read, to cost them."""
MAX_NAME_LENGTH = 256
"""The longest environment variable name a role may add."""


def _passed_through(*keys: tuple[str, str, dict[str, str], int]) -> dict[str, Any]:
    """A list of core objects passed through to pods as they are, with each of ``keys`` (its name, its description,
    the rule that checks it, its longest length) declared as a string so that its rule checks it."""
    declared = {
        key: {"type": "string", "maxLength": max_length, "description": description, **validations(rule)}
        for key, description, rule, max_length in keys
    }
    item = {**OPAQUE_OBJECT, "properties": declared}
    return {"type": "array", "maxItems": MAX_PASSED_THROUGH, "items": item}


class Resources(Model):
    """Compute resources of the role's container, as in a pod (quantities checked when the RLJob is applied)."""

    limits: dict[str, Quantity] | None = Field(None, description="e.g. {cpu: 4, memory: 16Gi, nvidia.com/gpu: 1}")
    requests: dict[str, Quantity] | None = Field(
        None, description="What the scheduler reserves, by resource name: quantities as in limits. Default: the limits."
    )
    claims: list[dict[str, Any]] | None = Field(
        None, description="Dynamic resource claims the container uses, as in a pod.", json_schema_extra=OPAQUE_LIST
    )


class EnvVar(Model):
    """An environment variable of the role's container, as in a pod: a value, or valueFrom a source."""

    model_config = ConfigDict(json_schema_extra=validations(CREDENTIAL_ENV_RULE))

    name: Annotated[str, Field(pattern=ENV_NAME_PATTERN, max_length=MAX_NAME_LENGTH)] = Field(
        description="The variable's name; not one the operator sets (LOCKSTEP_*, POD_NAME, POD_NAMESPACE, and the "
        "torch.distributed rendezvous: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK), nor one that changes "
        "what vLLM computes or the code the image runs (VLLM_* but those that size memory and threads or set logs, "
        "PYTHONPATH, PYTHONHOME).",
        json_schema_extra=validations(RESERVED_ENV_RULE, LOCKED_ENV_RULE),
    )
    value: str | None = Field(None, description="The value; unset with valueFrom.")
    value_from: dict[str, Any] | None = Field(
        None,
        description="A source of the value, as in a pod: fieldRef, resourceFieldRef, configMapKeyRef, secretKeyRef.",
        json_schema_extra=OPAQUE_OBJECT,
    )


class PodOverrides(Model):
    """Kubernetes pod fields passed through to the pods of one role."""

    resources: Resources | None = None
    node_selector: dict[str, str] | None = Field(
        None, description="Node labels the role's pods must run on, as in a pod. Default: any node."
    )
    tolerations: list[dict[str, Any]] | None = Field(
        None, description="Taints the role's pods tolerate, as in a pod.", json_schema_extra=OPAQUE_LIST
    )
    affinity: dict[str, Any] | None = Field(
        None, description="Node and pod affinity of the role's pods, as in a pod.", json_schema_extra=OPAQUE_OBJECT
    )
    env: list[EnvVar] | None = Field(
        None,
        max_length=MAX_PASSED_THROUGH,
        description="Environment variables added to the role's container, after the ones the operator sets. HOME "
        "(default /home/lockstep, the operator's writable emptyDir) may be set here instead.",
    )
    volumes: list[dict[str, Any]] | None = Field(
        None,
        max_length=MAX_PASSED_THROUGH,
        description="Volumes added to the role's pods, as in a pod (e.g. the model's, at spec.model.uri); names "
        "starting with lockstep- are the operator's.",
        json_schema_extra=_passed_through(("name", "The volume's name, as in a pod.", RESERVED_VOLUME_RULE, 63)),
    )
    volume_mounts: list[dict[str, Any]] | None = Field(
        None,
        max_length=MAX_PASSED_THROUGH,
        description="Mounts of those volumes in the role's container, as in a pod. The operator mounts "
        "/etc/lockstep (the effective configuration) and /var/lib/lockstep (spec.weightSync.volume) itself: nothing "
        "may be mounted at or under them. It also mounts emptyDirs on the read-only root filesystem at /tmp, "
        "/home/lockstep and (GPU pods) /dev/shm, which a mount here at the same path replaces. A volume named "
        "lockstep-* is the operator's and may not be mounted here.",
        json_schema_extra=_passed_through(
            (
                "name",
                "The mounted volume's name; not one of the operator's (lockstep-*).",
                RESERVED_VOLUME_MOUNT_RULE,
                63,
            ),
            ("mountPath", "Where the volume appears in the container, as in a pod.", RESERVED_MOUNT_RULE, 1024),
        ),
    )


GROUP_SPLIT_RULE = cel(
    "self.dataParallelSize == 1 ? (self.tensorParallelSize * self.pipelineParallelSize) % self.pods == 0 "
    ": self.dataParallelSize % self.pods == 0",
    "spec.actors.group: the engine's ranks must split into whole engines over the group's pods, every pod running "
    "the same number (vLLM gives each node the same local world size): with dataParallelSize 1, "
    "tensorParallelSize x pipelineParallelSize must be a multiple of pods; with dataParallelSize above 1, "
    "dataParallelSize must be a multiple of pods (each pod runs whole data-parallel engines); change the sizes or "
    "pods",
)
"""No messageExpression with the numbers: the API server estimates its cost (string(int) concatenations) at more
than 100 times the CRD's budget and refuses the CRD."""
EXPERT_PARALLEL_RULE = cel(
    "!self.expertParallel || self.tensorParallelSize * self.dataParallelSize > 1",
    "spec.actors.group.expertParallel shards a MoE model's experts over tensorParallelSize times "
    "dataParallelSize ranks, and both are 1: raise one of them, or set expertParallel to false",
    field_path=".expertParallel",
)


class ActorGroup(Model):
    """One vLLM engine split over several pods, created, scheduled and restarted as a unit (a LeaderWorkerSet
    group, docs/actor-groups.md). Each pod runs tensorParallelSize x pipelineParallelSize x dataParallelSize / pods
    ranks (GPUs on a GPU node)."""

    model_config = ConfigDict(json_schema_extra=validations(GROUP_SPLIT_RULE, EXPERT_PARALLEL_RULE))

    pods: Annotated[int, Field(ge=2, le=64)] = Field(
        description="Pods per group: a leader, which serves the engine's API and runs the barrier agent, and "
        "pods - 1 workers running vLLM's headless ranks."
    )
    tensor_parallel_size: Annotated[int, Field(ge=1, le=1024)] = Field(
        1, description="Ranks each layer is sharded over (vLLM's --tensor-parallel-size), across pods. Default: 1."
    )
    pipeline_parallel_size: Annotated[int, Field(ge=1, le=64)] = Field(
        1, description="Stages the layers are split into (vLLM's --pipeline-parallel-size). Default: 1."
    )
    data_parallel_size: Annotated[int, Field(ge=1, le=1024)] = Field(
        1,
        description="Engines of tensorParallelSize x pipelineParallelSize ranks each, behind the leader's API "
        "(vLLM's --data-parallel-size). Default: 1.",
    )
    expert_parallel: bool = Field(
        False,
        description="Shard a MoE model's experts over tensorParallelSize x dataParallelSize ranks instead of "
        "tensor-parallel slicing them (vLLM's --enable-expert-parallel). Default: false.",
    )

    @property
    def ranks(self) -> int:
        """The group's vLLM workers, over all its pods: tensor x pipeline x data parallel."""
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.data_parallel_size


GROUP_IMMUTABLE_RULE = cel(
    "has(self.group) == has(oldSelf.group) && (!has(self.group) || self.group == oldSelf.group)",
    "spec.actors.group is immutable while the RLJob exists, and so is whether it is set: the groups' engines are "
    "split for it and their pods are a LeaderWorkerSet's (single-pod actors are the operator's own); delete the "
    "RLJob and create it again with the spec.actors.group you want",
    field_path=".group",
)
"""A transition rule on spec.actors, not on spec.actors.group, as LORA_IMMUTABLE_RULE."""
GROUP_TENSOR_PARALLEL_RULE = cel(
    "!has(self.group) || !has(self.vllm.tensorParallelSize)",
    "spec.actors.vllm.tensorParallelSize and spec.actors.group both size the engine's tensor parallelism: with a "
    "group, set spec.actors.group.tensorParallelSize and remove spec.actors.vllm.tensorParallelSize",
    field_path=".vllm.tensorParallelSize",
)


REPLAY_PREFIX_CACHING_RULE = cel(
    "!self.routingReplay || !has(self.vllm.enablePrefixCaching)",
    "spec.actors.routingReplay turns vLLM's prefix caching on itself (vLLM returns the routed experts only with "
    "it, and each weight update then clears the cache): remove spec.actors.vllm.enablePrefixCaching, or set "
    "routingReplay to false",
    field_path=".vllm.enablePrefixCaching",
    reason="FieldValueInvalid",
)
REPLAY_PIPELINE_RULE = cel(
    "!self.routingReplay || !has(self.group) || self.group.pipelineParallelSize == 1",
    "spec.actors.routingReplay: vLLM cannot return the routed experts with pipeline parallelism: set "
    "spec.actors.group.pipelineParallelSize to 1 (shard with tensorParallelSize or expertParallel instead), or set "
    "routingReplay to false",
    field_path=".routingReplay",
    reason="FieldValueInvalid",
)


class ActorSpec(PodOverrides):
    model_config = ConfigDict(
        json_schema_extra=validations(
            GROUP_IMMUTABLE_RULE, GROUP_TENSOR_PARALLEL_RULE, REPLAY_PREFIX_CACHING_RULE, REPLAY_PIPELINE_RULE
        )
    )

    replicas: Annotated[int, Field(ge=1, le=4096)] = Field(
        1,
        description="vLLM rollout servers: pods, or groups of pods when group is set. To stop a job's pods, set "
        "spec.suspend instead of 0.",
    )
    group: ActorGroup | None = Field(
        None,
        description="Split each actor's engine over several pods: the job's groups are one LeaderWorkerSet, which "
        "the cluster must run (docs/actor-groups.md). Immutable. Default: unset, each actor is one pod.",
    )
    image: Annotated[str, Field(min_length=1)] = Field(
        description="The actors' (and the preflight pod's) container image: lockstep_workers with vLLM, e.g. "
        "ghcr.io/lockstep-dev/lockstep-actor (GPUs) or lockstep-worker-cpu (images/ in the repository)."
    )
    vllm: VllmSettings = Field(default_factory=VllmSettings, description="vLLM arguments for the rollout servers.")
    routing_replay: bool = Field(
        False,
        description="Routing replay (R3) for a mixture-of-experts model: the actors return the experts each token "
        "was routed to, with each sample, for the trainer to replay in its routers "
        "(docs/parity.md#routing-replay-moe). "
        "It turns vLLM's prefix caching on and makes each weight update clear the cache; not with pipeline "
        "parallelism; moot on a dense model. Needs vLLM's CUDA build (the CPU build cannot return routed experts: "
        "its actors refuse to start). The ParityPolicy may require or forbid it (its spec.routingReplay).",
    )


class Algorithm(StrEnum):
    GSPO = "gspo"
    PPO = "ppo"
    GRPO = "grpo"


class CorrectionLevel(StrEnum):
    TOKEN = "token"
    SEQUENCE = "sequence"
    GEOMETRIC = "geometric"


class CorrectionMode(StrEnum):
    TRUNCATE = "truncate"
    MASK = "mask"


CORRECTION_OFF_RULE = cel(
    "self.enabled || !(has(self.level) || has(self.lower) || has(self.veto))",
    "spec.trainer.objective.rolloutCorrection.enabled is false, so level, lower and veto would be ignored: remove "
    "them, or set enabled: true",
    field_path=".enabled",
    reason="FieldValueInvalid",
)


class RolloutCorrection(Model):
    """The rollout correction (docs/corrections.md): each term of the loss is weighted by a function of the
    importance ratio rho = pi_proximal / pi_behaviour, the trainer's recomputed probability of a sampled token over
    the rollout engine's. It is kept apart from the policy ratio pi_new / pi_proximal, which is clipped."""

    model_config = ConfigDict(json_schema_extra=validations(CORRECTION_OFF_RULE))

    enabled: bool = Field(
        True,
        description="Whether the loss is weighted; off, every weight is 1, and rollout_is_mean and the fractions "
        "beyond the bounds still measure rho.",
    )
    level: CorrectionLevel | None = Field(
        None,
        description="token: one weight per token, rho_t; sequence: one per sequence, the product of its tokens' "
        "rho; geometric: one per sequence, their geometric mean (the length-normalised ratio). Unset: the level of "
        "the algorithm's own ratio, token for ppo and grpo, geometric for gspo.",
    )
    mode: CorrectionMode = Field(
        CorrectionMode.TRUNCATE,
        description="truncate (TIS): the weight is clamped to [lower, upper]; mask (MIS, IcePop's band): a weight "
        "outside [lower, upper] is 0 (its tokens stay in the loss's denominator), one inside is rho itself.",
    )
    upper: Annotated[float, Field(gt=1)] = Field(
        2.0, description="The upper bound on the weight (TIS's cap C in min(rho, C))."
    )
    lower: Annotated[float, Field(ge=0, lt=1)] | None = Field(
        None,
        description="The lower bound on the weight. Unset: 0 (no lower clamp) for truncate, 1 / upper for mask.",
    )
    veto: Annotated[float, Field(gt=0, lt=1)] | None = Field(
        None,
        description="A sequence with any token whose rho is below this gets weight 0 (verl's veto threshold, e.g. "
        "1e-4). Unset: no veto.",
    )


class AdvantageEstimator(StrEnum):
    GRPO = "grpo"
    DR_GRPO = "dr_grpo"
    RLOO = "rloo"
    REINFORCE_PLUS_PLUS = "reinforce_plus_plus"


class LossAggregation(StrEnum):
    TOKEN_MEAN = "token-mean"
    SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"
    SEQ_MEAN_TOKEN_SUM_NORM = "seq-mean-token-sum-norm"


class KlEstimator(StrEnum):
    K1 = "k1"
    K2 = "k2"
    K3 = "k3"


class LearningRateSchedule(StrEnum):
    CONSTANT = "constant"
    LINEAR = "linear"
    COSINE = "cosine"


ONE_WARMUP_RULE = cel(
    "!has(self.warmupRatio) || self.warmupRatio == 0.0 || !has(self.warmupSteps) || self.warmupSteps == 0",
    "spec.trainer.objective.optimizer sets the warm-up twice: warmupSteps counts its steps, warmupRatio its share of "
    "spec.trainer.steps; keep one",
    field_path=".warmupRatio",
)
CONSTANT_SCHEDULE_RULE = cel(
    "!has(self.minLearningRateRatio) || self.minLearningRateRatio == 0.0 || (has(self.schedule) && "
    "self.schedule != 'constant')",
    "spec.trainer.objective.optimizer.minLearningRateRatio is where a linear or cosine schedule ends; a constant "
    "schedule never decays: remove it, or set schedule: linear or cosine",
    field_path=".minLearningRateRatio",
    reason="FieldValueInvalid",
)


class OptimizerSettings(Model):
    """AdamW (torch.optim.AdamW) on the parameters that train, gradient-norm clipping, and the learning rate's
    warm-up and schedule over the job's steps (docs/recipes.md); the peak rate is spec.trainer.objective.learningRate.
    """

    model_config = ConfigDict(json_schema_extra=validations(CONSTANT_SCHEDULE_RULE, ONE_WARMUP_RULE))

    betas: list[Annotated[float, Field(ge=0, lt=1)]] = Field(
        [0.9, 0.999],
        min_length=2,
        max_length=2,
        description="AdamW's [beta1, beta2], the decay rates of the gradient's first and second moment estimates.",
    )
    eps: Annotated[float, Field(gt=0, le=1)] = Field(1e-8, description="AdamW's epsilon, added to the denominator.")
    weight_decay: Annotated[float, Field(ge=0, le=1)] = Field(
        0.0, description="AdamW's decoupled weight decay (0: Adam's update)."
    )
    max_grad_norm: Annotated[float, Field(ge=0)] = Field(
        1.0,
        description="Each optimiser step first scales the gradient down to this global L2 norm (over every rank's "
        "shard) when it is larger; the norm before clipping is the grad_norm metric. 0: no clipping.",
    )
    warmup_steps: Annotated[int, Field(ge=0)] = Field(
        0,
        description="The learning rate rises linearly over this many steps, step n learning at n / warmupSteps of "
        "learningRate, before the schedule. 0: no warm-up (or warmupRatio's).",
    )
    warmup_ratio: Annotated[float, Field(ge=0, le=1)] = Field(
        0.0,
        description="The warm-up as a fraction of spec.trainer.steps instead: ceil(warmupRatio x steps) steps, as "
        "Hugging Face's warmup_ratio counts them (verl's lr_warmup_steps_ratio). Not with warmupSteps.",
    )
    schedule: LearningRateSchedule = Field(
        LearningRateSchedule.CONSTANT,
        description="After the warm-up: constant (learningRate), or a linear or cosine decay that reaches "
        "minLearningRateRatio x learningRate at the job's last step (spec.trainer.steps).",
    )
    min_learning_rate_ratio: Annotated[float, Field(ge=0, le=1)] = Field(
        0.0, description="Where a linear or cosine schedule ends, as a fraction of learningRate."
    )

    def warmup(self, steps: int) -> int:
        """How many of a job's ``steps`` warm up: warmupSteps, or warmupRatio's share of them rounded up."""
        return self.warmup_steps or math.ceil(self.warmup_ratio * steps)


class Objective(Model):
    algorithm: Algorithm = Field(
        Algorithm.GSPO,
        description="The clipped policy-gradient objective: ppo (token ratios, mean over all tokens), grpo (token "
        "ratios, mean within each sequence, then over sequences) or gspo (one ratio per sequence); lossAggregation "
        "may change how the terms are averaged.",
    )
    advantage: AdvantageEstimator = Field(
        AdvantageEstimator.GRPO,
        description="Each completion's advantage from the rewards (docs/recipes.md): grpo (its reward minus its "
        "group's mean, over the group's standard deviation), dr_grpo (minus the group's mean, no division), rloo "
        "(minus the mean of the group's other completions) or reinforce_plus_plus (the rewards whitened over the "
        "whole step's tokens, every rank's: no group baseline).",
    )
    loss_aggregation: LossAggregation | None = Field(
        None,
        description="How the per-token terms become the loss: token-mean (over every token of the minibatch), "
        "seq-mean-token-mean (each sequence's mean, then the mean over sequences) or seq-mean-token-sum-norm (each "
        "sequence's sum over spec.trainer.rollout.maxTokens, a constant, then the mean over sequences: Dr. GRPO's). "
        "Unset: the algorithm's own, token-mean for ppo, seq-mean-token-mean for grpo and gspo.",
    )
    entropy_coefficient: Annotated[float, Field(ge=0)] = Field(
        0.0,
        description="The loss subtracts this times the trained policy's entropy at the sampled tokens, aggregated "
        "as the loss is (lossAggregation): a bonus for exploration; the term's size is the entropy_bonus metric. 0: "
        "none.",
    )
    kl_coefficient: Annotated[float, Field(ge=0)] = Field(
        0.0,
        description="The loss adds this times an estimate of KL(trained policy || reference) at the sampled tokens, "
        "aggregated as the loss is; the reference is the model the job started from (spec.model): in a LoRA job the "
        "same model with the adapter disabled (no second copy), in full fine-tuning a frozen copy that each trainer "
        "rank holds a shard of (fp32 parameters: a quarter more memory than the trained copy with its gradients and "
        "AdamW state). Metrics kl_ref (the estimate's mean over tokens) and kl_loss (the term). 0: none.",
    )
    router_aux_loss_coefficient: Annotated[float, Field(ge=0)] = Field(
        0.0,
        description="Mixture-of-experts models: the loss adds this times the routers' auxiliary load-balancing loss "
        "(the model family's own, as transformers computes it with output_router_logits), of each micro-batch (so "
        "it varies with tokensPerMicroBatch and the trainer's replicas), weighted by its sequences; metric "
        "router_aux_loss. 0: none, as RL recipes run it (the trainer never adds it unasked).",
    )
    kl_estimator: KlEstimator = Field(
        KlEstimator.K3,
        description="The per-token estimate of the KL, with x = log pi - log pi_ref (Schulman's): k1 = x, k2 = x^2 / "
        "2, k3 = exp(-x) + x - 1 (low variance, always >= 0; verl's low_var_kl, clamped as verl clamps it).",
    )
    kl_reference_offload: bool = Field(
        False,
        description="Full fine-tuning with klCoefficient: keep the frozen reference's parameters in host memory, each "
        "layer copied to the accelerator as its forward pass needs it (FSDP2's CPU offload): no accelerator memory "
        "for the reference between its passes, for one copy of the model from host to accelerator a step. Refused "
        "without klCoefficient or with spec.trainer.lora (whose reference is its base: no copy to offload).",
    )
    clip_epsilon_low: Annotated[float, Field(gt=0, lt=1)] = Field(
        0.2, description="Lower clip range: the ratio is clipped below at 1 - clipEpsilonLow."
    )
    clip_epsilon_high: Annotated[float, Field(gt=0)] = Field(
        0.28, description="Upper clip range: the ratio is clipped above at 1 + clipEpsilonHigh."
    )
    rollout_correction: RolloutCorrection = Field(
        default_factory=RolloutCorrection,
        description="How the loss corrects for the behaviour policy (the rollout engine) differing from the "
        "proximal policy (the trainer's recompute); by default truncated importance sampling with cap 2, at the "
        "level of the algorithm's own ratio.",
    )
    learning_rate: Annotated[float, Field(gt=0, le=1)] = Field(
        1e-6, description="The optimiser's peak learning rate, after the warm-up (optimizer.warmupSteps)."
    )
    optimizer: OptimizerSettings = Field(
        default_factory=OptimizerSettings,
        description="AdamW's settings, gradient-norm clipping (at 1.0 by default) and the learning-rate schedule.",
    )
    minibatches: Annotated[int, Field(ge=1, le=64)] = Field(
        2,
        description="Optimiser steps per batch of rollouts, each on a slice of its prompt groups; ratios are "
        "taken against the weights the batch started from, so clipping acts from the second on.",
    )
    tokens_per_micro_batch: Annotated[int, Field(ge=1)] | None = Field(
        None,
        description="Gradient accumulation: each minibatch is run forward and backward in equal micro-batches of "
        "about this many tokens (padding included) per trainer rank, so that a step's batch need not fit in memory "
        "at once. Unset: a minibatch in one pass.",
    )


CALLABLE_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$"
"""``package.module:function``: a Python callable importable in the trainer's image."""


class OverlongMode(StrEnum):
    MASK = "mask"
    PENALTY = "penalty"


OVERLONG_WINDOW_RULE = cel(
    "(self.mode == 'penalty') == has(self.window)",
    "spec.trainer.rollout.overlong.window is the penalty's window: set it with mode penalty, remove it with mode mask",
    field_path=".window",
    reason="FieldValueInvalid",
)
OVERLONG_FACTOR_RULE = cel(
    "self.mode == 'penalty' || !has(self.penaltyFactor)",
    "spec.trainer.rollout.overlong.penaltyFactor scales the penalty, which mode mask does not give: remove it, or set "
    "mode: penalty",
    field_path=".penaltyFactor",
    reason="FieldValueInvalid",
)


class Overlong(Model):
    """What a completion cut at maxTokens costs (DAPO's overlong handling). A completion's length L is the number of
    tokens the policy sampled (every turn's, in a multi-turn episode); it is cut when L reaches maxTokens M (the
    actors report no finish reason, so one whose stop token is its M-th counts as cut too)."""

    model_config = ConfigDict(json_schema_extra=validations(OVERLONG_WINDOW_RULE, OVERLONG_FACTOR_RULE))

    mode: OverlongMode = Field(
        description="mask: a cut completion stays out of the loss (its reward still counts in its group's "
        "baseline); penalty: DAPO's soft overlong punishment, added to every completion's reward: 0 while L <= M - "
        "window, (M - window - L) / window times penaltyFactor within the last window tokens, -penaltyFactor beyond "
        "M (step metric overlong_penalty, the mean).",
    )
    window: Annotated[int, Field(ge=1)] | None = Field(
        None,
        description="With mode penalty, the last tokens before maxTokens over which the penalty grows from 0 to "
        "-penaltyFactor (DAPO's L_cache, e.g. 4096 of 20480); at most maxTokens.",
    )
    penalty_factor: Annotated[float, Field(gt=0)] | None = Field(
        None, description="With mode penalty, the penalty at maxTokens and beyond, negated. Unset: 1."
    )

    @property
    def factor(self) -> float:
        """penaltyFactor, or its default."""
        return self.penalty_factor if self.penalty_factor is not None else 1.0


OVERLONG_WINDOW_BOUND_RULE = cel(
    "!has(self.overlong) || !has(self.overlong.window) || self.overlong.window <= self.maxTokens",
    "spec.trainer.rollout.overlong.window must be at most spec.trainer.rollout.maxTokens: the penalty's window is "
    "the last tokens before it; lower the window, or raise maxTokens",
    field_path=".overlong.window",
    reason="FieldValueInvalid",
)
DYNAMIC_SAMPLING_BOUND_RULE = cel(
    "self.dynamicSampling || !has(self.maxExtraGroups)",
    "spec.trainer.rollout.maxExtraGroups bounds dynamic sampling, which is off: set dynamicSampling: true, or remove "
    "maxExtraGroups",
    field_path=".maxExtraGroups",
    reason="FieldValueInvalid",
)


class RolloutSettings(Model):
    model_config = ConfigDict(json_schema_extra=validations(DYNAMIC_SAMPLING_BOUND_RULE, OVERLONG_WINDOW_BOUND_RULE))

    prompts_per_step: Annotated[int, Field(ge=1, le=65536)] = Field(8, description="Prompts sampled per step.")
    groups_in_flight: Annotated[int, Field(ge=1, le=65536)] | None = Field(
        None,
        description="How many prompt groups (a prompt's samplesPerPrompt completions) the trainer keeps in flight "
        "on the actors at once, taking prompts in the dataset's order, while it learns and publishes; a group is "
        "sent only once the actors serve weights within spec.trainer.maxLag of the step that learns it, so maxLag "
        "bounds how far generation runs ahead (0: none, synchronous RL). Unset: 2 x promptsPerStep, this step's "
        "and the next's, so that the actors are not idle while the trainer waits for a step's last groups.",
    )
    on_policy_groups: Annotated[int, Field(ge=0, le=65536)] = Field(
        1,
        description="How many of each step's prompt groups (its last ones) are sampled under exactly the weights "
        "the step learns with, whatever spec.trainer.maxLag is: their tokens measure the train-inference mismatch "
        "every step (onpolicy_mean_abs_logprob_diff, held to the ParityPolicy's meanAbsLogprobDiff). The step waits "
        "for its weight update and these groups' sampling. 0: the pipeline never waits, and a step with no token "
        "sampled under the trainer's weights reports its mismatch as none, unmeasured.",
    )
    samples_per_prompt: Annotated[int, Field(ge=2, le=1024)] = Field(
        8, description="Completions per prompt: a group, whose mean reward is the baseline (GRPO/GSPO)."
    )
    max_tokens: Annotated[int, Field(ge=1)] = Field(16, description="Longest completion, in tokens.")
    overlong: Overlong | None = Field(
        None,
        description="What a completion cut at maxTokens costs: masked out of the loss, or DAPO's soft overlong "
        "penalty on its reward (the step metric truncated_fraction counts them, set or not). Unset: nothing, it is "
        "learned as any other.",
    )
    temperature: Annotated[float, Field(gt=0)] = Field(
        1.0, description="Sampling temperature; the trainer applies the same one to its logprobs."
    )
    top_p: Annotated[float, Field(gt=0, le=1)] = Field(
        1.0,
        description="Nucleus sampling; the trainer applies vLLM's exact top-p mask to its logprobs, and leaves "
        "out of the loss the few tokens that fall outside its own set (counted as outside_top_p_fraction).",
    )
    function: str | None = Field(
        None,
        pattern=CALLABLE_PATTERN,
        description="How each sample is taken, package.module:function: an async function called as "
        "function(row, prompt_token_ids, client) that samples the policy with await client.generate(token_ids, "
        "sampling) as many turns as it likes and returns an Episode (token ids after the prompt, their logprobs, and "
        "a mask of the tokens the policy produced; the tokens the environment inserted stay out of the loss); see "
        "lockstep_workers.episodes. Unset: one completion of the prompt.",
    )

    dynamic_sampling: bool = Field(
        False,
        description="DAPO's dynamic sampling: a prompt group whose rewards are all equal (no advantage, so no "
        "gradient) is dropped, and another prompt of the step's is sampled in its place, until the step has "
        "promptsPerStep groups with signal or has sampled maxExtraGroups more (step metrics dropped_groups, "
        "extra_groups and unfilled_groups). Each step then draws promptsPerStep + maxExtraGroups prompts from the "
        "dataset (or the prompt source) and samples the extra ones only as needed; those it does not need are not "
        "sampled in that pass.",
    )
    max_extra_groups: Annotated[int, Field(ge=1, le=65536)] | None = Field(
        None,
        description="With dynamicSampling, the most prompt groups a step samples beyond promptsPerStep. Once they "
        "are spent, the step goes on with the groups it has, filled up to promptsPerStep with its earliest dropped "
        "ones (counted as unfilled_groups). Unset: promptsPerStep.",
    )

    @property
    def extra_groups(self) -> int:
        """How many prompt groups a step may sample beyond promptsPerStep: maxExtraGroups (or its default) with
        dynamic sampling, else 0."""
        if not self.dynamic_sampling:
            return 0
        return self.max_extra_groups if self.max_extra_groups is not None else self.prompts_per_step

    @property
    def prompts_drawn_per_step(self) -> int:
        """How many prompts each step draws: promptsPerStep, and the extra ones dynamic sampling may sample."""
        return self.prompts_per_step + self.extra_groups

    @property
    def in_flight(self) -> int:
        """groupsInFlight, or its default."""
        return self.groups_in_flight if self.groups_in_flight is not None else 2 * self.prompts_per_step


class PromptTemplate(StrEnum):
    CHAT = "Chat"
    RAW = "Raw"


class Dataset(Model):
    """Where a job's prompts come from: rows of a file or a saved dataset on a volume the trainer mounts."""

    train: Annotated[str, Field(min_length=1)] = Field(
        description="The training rows: a path in the trainer pod (on a volume in spec.trainer.volumes) to a .jsonl "
        "or .parquet file, or to a directory a Hugging Face dataset was saved to (save_to_disk; a DatasetDict's "
        "split is its subdirectory, e.g. /data/gsm8k/train)."
    )
    eval: Annotated[str, Field(min_length=1)] | None = Field(
        None, description="The evaluation rows (spec.trainer.eval), in the same forms as train. Default: none."
    )
    prompt_field: Annotated[str, Field(min_length=1)] = Field(
        "prompt",
        description="The row field that holds the prompt: a string, or chat messages (a list of {role, content}).",
    )
    reward_fields: list[Annotated[str, Field(min_length=1)]] = Field(
        default_factory=list,
        description="Fields every row must have for the reward, e.g. [answer]: checked before training (the reward "
        "gets the whole row).",
    )
    template: PromptTemplate = Field(
        PromptTemplate.CHAT,
        description="Chat: the model tokenizer's chat template (apply_chat_template, with the generation prompt) "
        "renders the prompt, a string as one user message; Raw: the prompt string is tokenized as it is.",
    )
    shuffle_seed: int = Field(
        0,
        description="Seed of the deterministic shuffle of the training rows; each pass over them is shuffled anew. "
        "Step N takes the next promptsPerStep rows, so a resumed trainer goes on at the row it stopped at.",
    )


class Evaluation(Model):
    every_steps: Annotated[int, Field(ge=0)] = Field(
        0,
        description="Every this many steps, and before the first, the trainer samples the eval split greedily from "
        "the actors, scores it with the job's reward and reports eval_reward. 0: never. Needs dataset.eval.",
    )
    prompts: Annotated[int, Field(ge=1)] | None = Field(
        None, description="How many of the eval split's rows (the first ones) each evaluation samples. Default: all."
    )


MODULE_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"
MAX_TARGET_MODULES = 64
"""The most names spec.trainer.lora.targetModules may hold (a model has a handful of linear module names): bounded,
like the other lists the CRD's CEL rules read (the rule that keeps spec.trainer.lora immutable compares it)."""


class LoraSettings(Model):
    """A LoRA adapter trained on the frozen base model (docs/lora.md): the trainer trains and publishes only the
    adapter (PEFT), and the actors serve each version as a vLLM LoRA adapter, loaded without pausing generation."""

    rank: Annotated[int, Field(ge=1, le=256)] = Field(16, description="The adapter's rank r.")
    alpha: Annotated[float, Field(gt=0)] = Field(
        32, description="LoRA's alpha: the adapter's update is scaled by alpha / rank."
    )
    dropout: Annotated[float, Field(ge=0, lt=1)] = Field(
        0.0,
        description="Dropout on the adapter's input while the trainer learns. Above 0 the trainer's logprobs of a "
        "step's own tokens differ from the actors' by the dropout's noise: keep 0 for on-policy ratios.",
    )
    target_modules: list[Annotated[str, Field(pattern=MODULE_NAME_PATTERN, max_length=MAX_NAME_LENGTH)]] | None = Field(
        None,
        min_length=1,
        max_length=MAX_TARGET_MODULES,
        description="Names of the base model's linear modules that get an adapter, e.g. [q_proj, v_proj]. "
        "Default: every linear module of the decoder layers (attention and MLP projections), never the "
        "lm_head. A name the model does not have stops the trainer, naming those it has.",
    )
    train_lm_head: bool = Field(
        False,
        description="Whether the lm_head gets an adapter too. Off: the head stays the base model's, computed in "
        "the dtype the ParityPolicy locks (fp32).",
    )


MLFLOW_URI_PATTERN = r"^(https?://\S+|databricks(://\S+)?)$"


class MlflowTracking(Model):
    """One MLflow run for the job (docs/observability.md#experiment-tracking): every step's metrics, its
    evaluations, and its effective configuration as parameters."""

    tracking_uri: Annotated[str, Field(pattern=MLFLOW_URI_PATTERN)] | None = Field(
        None,
        description="An MLflow tracking server: http://, https:// or databricks. Its credentials come from a "
        "Secret through spec.trainer.env (MLFLOW_TRACKING_TOKEN, or MLFLOW_TRACKING_USERNAME and "
        "MLFLOW_TRACKING_PASSWORD, with valueFrom.secretKeyRef; an inline value of a credential is refused). "
        "Default: unset, a store in the job's directory on spec.weightSync.volume, mlflow.db beside metrics.jsonl "
        "with the artifacts in mlflow-artifacts/ (no server: `mlflow ui --backend-store-uri sqlite:///<dir>/mlflow.db`).",
    )
    experiment: Annotated[str, Field(min_length=1, max_length=500)] | None = Field(
        None, description="The MLflow experiment, created when missing. Default: <namespace>/<job name>."
    )


class Tracking(Model):
    """Experiment tracking of the trainer's run (docs/observability.md), beside metrics.jsonl and Prometheus."""

    tensorboard: bool = Field(
        False,
        description="Write TensorBoard event files in tensorboard/ beside metrics.jsonl, in the job's directory on "
        "spec.weightSync.volume (no server needed: point `tensorboard --logdir` at it): every step's metrics under "
        "metrics.jsonl's names, each evaluation's eval_reward, and the effective configuration with its fingerprint "
        "at the step each trainer starts from. A restarted trainer goes on with the same run. Needs the tensorboard "
        "package in the trainer's image (lockstep[workers] has it). Default: false.",
    )
    mlflow: MlflowTracking | None = Field(
        None,
        description="Log the run to MLflow through its own client: every step's metrics under metrics.jsonl's "
        "names, at the step's number; the effective configuration as parameters, with its fingerprint as a tag and "
        "each trainer's start's configuration as an artifact. A restarted trainer resumes the same run. Needs "
        "mlflow-skinny in the trainer's image (lockstep[workers] has it). Default: unset, no MLflow.",
    )


class RewardErrorAction(StrEnum):
    ZERO = "Zero"
    FAIL = "Fail"


REWARD_NAME_PATTERN = r"^[a-z][a-z0-9_]*$"
MAX_REWARDS = 16
"""The most reward functions spec.trainer.rewards may list: bounded, as the lists CEL rules read must be."""


class WeightedReward(Model):
    """One of several reward functions: a completion's reward is the sum of each function's times its weight."""

    name: Annotated[str, Field(pattern=REWARD_NAME_PATTERN, max_length=63)] = Field(
        description="The function's name in the step metrics: rewards/<name> is its own mean reward over the step's "
        "completions, before its weight.",
    )
    function: str = Field(
        pattern=CALLABLE_PATTERN,
        description="The reward function, package.module:function, called as spec.trainer.reward is.",
    )
    weight: float = Field(1.0, description="What the function's reward is multiplied by in the sum.")


UNIQUE_REWARD_NAMES_RULE = cel(
    "self.all(x, self.exists_one(y, y.name == x.name))",
    "spec.trainer.rewards: each reward function needs a name of its own, its step metric rewards/<name>",
    reason="FieldValueDuplicate",
)


class Training(Model):
    """What the trainer process runs: the operator passes these fields to it as they are (PodConfig.training)."""

    reward: str | None = Field(
        None,
        pattern=CALLABLE_PATTERN,
        description="The reward function, package.module:function. One with parameters (completion, prompt, row) "
        "gets the decoded completion, the prompt's text and its dataset row, e.g. "
        "lockstep_workers.rewards:math_exact_match; any other is called as reward(prompt_token_ids, "
        "completion_token_ids), e.g. lockstep_workers.rewards:target_words. It returns a float. Set it or rewards.",
    )
    rewards: list[WeightedReward] | None = Field(
        None,
        min_length=1,
        max_length=MAX_REWARDS,
        description="Several reward functions instead of reward, e.g. correctness with weight 1 and format with "
        "weight 0.1: a completion's reward is the weighted sum, and each function's own mean is the step metric "
        "rewards/<name>. A function that raises counts in reward_errors and is scored as onRewardError says.",
        json_schema_extra=validations(UNIQUE_REWARD_NAMES_RULE),
    )
    on_reward_error: RewardErrorAction = Field(
        RewardErrorAction.FAIL,
        description="When the reward function raises (always counted as reward_errors and logged with the row): "
        "Zero scores the completion 0; Fail stops the trainer with the error.",
    )
    reward_processes: Annotated[int, Field(ge=1, le=256)] = Field(
        2, description="Processes that run the reward function (a process pool), so a slow one does not stall."
    )
    dataset: Dataset | None = Field(
        None, description="The prompts' dataset. Default: none; the prompt source (prompts) makes them."
    )
    eval: Evaluation = Field(default_factory=Evaluation, description="Evaluation during training.")
    prompts: str = Field(
        "lockstep_workers.rewards:random_prompts",
        pattern=CALLABLE_PATTERN,
        description="The prompt source when there is no dataset, package.module:function, called as "
        "prompts(step, count, seed) -> list of prompt token id lists.",
    )
    steps: Annotated[int, Field(ge=1)] = Field(100, description="Optimiser steps; the job succeeds after the last.")
    max_lag: Annotated[int, Field(ge=0)] = Field(
        1,
        description="How many versions behind the weights that learn it a sampled token may be, and so how far "
        "generation runs ahead of learning (the rollout producer, spec.trainer.rollout.groupsInFlight): 0 is "
        "synchronous on-policy RL (a step is sampled once the actors serve the previous step's weights); 1 samples "
        "the next step while this one learns and its update is in flight. A hard bound: a group with a token more "
        "than maxLag versions behind is dropped before the loss and its prompt sampled again (counted as "
        "stale_samples_dropped, and in status.mismatch.staleSamplesDropped).",
    )
    seed: int = Field(0, description="Seed of the trainer's random state and of the prompt source.")
    rollout: RolloutSettings = Field(
        default_factory=RolloutSettings, description="How each step samples from the actors."
    )
    objective: Objective = Field(default_factory=Objective, description="The loss and the optimiser.")
    checkpoint_every_steps: Annotated[int, Field(ge=0)] = Field(
        10,
        description="Every this many steps the trainer saves its model and optimizer shards, step and RNG states "
        "(torch.distributed.checkpoint) under the job's directory on spec.weightSync.volume, which every trainer rank "
        "must mount; a restarted trainer, with any number of replicas, resumes them. 0: never.",
    )
    checkpoints_kept: Annotated[int, Field(ge=1)] = Field(2, description="How many of the newest checkpoints are kept.")
    activation_checkpointing: bool = Field(
        False, description="Recompute each decoder layer's activations in the backward pass instead of keeping them."
    )
    tracking: Tracking = Field(default_factory=Tracking, description="Experiment tracking of the trainer's run.")
    lora: LoraSettings | None = Field(
        None,
        description="Train a LoRA adapter instead of every weight (docs/lora.md); each version is the adapter "
        "alone, and the actors take it without pausing. Needs spec.weightSync.backend filesystem. Default: unset, "
        "full fine-tuning.",
    )

    def reward_functions(self) -> list[WeightedReward]:
        """The reward functions and their weights: rewards, or reward alone with weight 1 (the CRD admits exactly one
        of the two)."""
        if self.rewards is not None:
            return self.rewards
        if self.reward is None:
            raise ValueError("spec.trainer: set reward, or rewards, the function(s) that score each completion")
        return [WeightedReward(name="reward", function=self.reward)]


REWARD_CHOICE_RULE = cel(
    "has(self.reward) != has(self.rewards)",
    "spec.trainer needs exactly one of reward (one function) and rewards (several, weighted): set one, remove the "
    "other",
    field_path=".reward",
    reason="FieldValueInvalid",
)
EVAL_SPLIT_RULE = cel(
    "self.eval.everySteps == 0 || (has(self.dataset) && has(self.dataset.eval))",
    "spec.trainer.eval.everySteps needs spec.trainer.dataset.eval, the rows to evaluate on: set it, or set "
    "everySteps to 0",
    field_path=".eval.everySteps",
)
ON_POLICY_GROUPS_RULE = cel(
    "self.rollout.onPolicyGroups <= self.rollout.promptsPerStep",
    "spec.trainer.rollout.onPolicyGroups must be at most spec.trainer.rollout.promptsPerStep: they are groups of "
    "each step's; lower it, or raise promptsPerStep",
    field_path=".rollout.onPolicyGroups",
)
TRAINER_SHARDS_RULE = cel(
    "self.rollout.promptsPerStep >= self.replicas * self.objective.minibatches",
    "spec.trainer.rollout.promptsPerStep must be at least spec.trainer.replicas times "
    "spec.trainer.objective.minibatches: each rank trains on whole prompt groups, in that many minibatches; "
    "raise promptsPerStep or lower the others",
    field_path=".rollout.promptsPerStep",
)
WARMUP_RULE = cel(
    "self.objective.optimizer.warmupSteps <= self.steps",
    "spec.trainer.objective.optimizer.warmupSteps must be at most spec.trainer.steps: a longer warm-up never "
    "reaches learningRate; lower it, or raise steps",
    field_path=".objective.optimizer.warmupSteps",
)

KL_OFFLOAD_RULE = cel(
    "!self.objective.klReferenceOffload || (self.objective.klCoefficient > 0.0 && !has(self.lora))",
    "spec.trainer.objective.klReferenceOffload offloads the frozen KL reference of a full fine-tuning job: it needs "
    "klCoefficient above 0 and no spec.trainer.lora (a LoRA job's reference is its base, no copy); set it to false",
    field_path=".objective.klReferenceOffload",
)
LORA_IMMUTABLE_RULE = cel(
    "has(self.lora) == has(oldSelf.lora) && (!has(self.lora) || self.lora == oldSelf.lora)",
    "spec.trainer.lora is immutable while the RLJob exists, and so is whether it is set: the actors were started "
    "for it and the trainer's checkpoints and committed weights are of that adapter (or of every weight); delete "
    "the RLJob and create it again with the spec.trainer.lora you want",
    field_path=".lora",
)
"""A transition rule on spec.trainer, not on spec.trainer.lora: a rule on the field itself runs only when both the
old and the new object have it, so adding or removing the adapter would pass."""


class TrainerSpec(PodOverrides, Training):
    model_config = ConfigDict(
        json_schema_extra=validations(
            TRAINER_SHARDS_RULE,
            ON_POLICY_GROUPS_RULE,
            EVAL_SPLIT_RULE,
            WARMUP_RULE,
            KL_OFFLOAD_RULE,
            LORA_IMMUTABLE_RULE,
            REWARD_CHOICE_RULE,
        )
    )

    replicas: Annotated[int, Field(ge=1, le=1024)] = Field(1, description="torch.distributed world size.")
    image: Annotated[str, Field(min_length=1)] = Field(
        description="The trainer's container image: lockstep_workers with torch (and vLLM for backend nccl), e.g. "
        "ghcr.io/lockstep-dev/lockstep-trainer (GPUs) or lockstep-worker-cpu (images/ in the repository)."
    )

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


class UpdateMode(StrEnum):
    """How the members of a weight update take a version (docs/barrier-protocol.md)."""

    LOCKSTEP = "Lockstep"
    ROLLING = "Rolling"


ROLLING_BACKEND_RULE = cel(
    "self.mode != 'Rolling' || self.backend == 'filesystem'",
    "spec.weightSync.mode Rolling needs backend filesystem: with nccl or gloo every member takes the weights in "
    "one transfer group at once; use mode Lockstep with them",
    field_path=".mode",
)

WEIGHTS_VOLUME_RULE = cel(
    "self.backend != 'filesystem' || has(self.volume)",
    "spec.weightSync.volume is required with backend filesystem: a volume every actor and trainer pod mounts, "
    "where the trainer writes weights and the actors read them, e.g. {persistentVolumeClaim: {claimName: weights}} "
    "(ReadWriteMany), or {hostPath: {path: /var/lib/lockstep}} when every pod runs on one node",
    field_path=".volume",
    reason="FieldValueRequired",
)


class WeightSync(Model):
    model_config = ConfigDict(json_schema_extra=validations(WEIGHTS_VOLUME_RULE, ROLLING_BACKEND_RULE))

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
    mode: UpdateMode = Field(
        UpdateMode.LOCKSTEP,
        description="How the actors take each new version. Both stage it (read and verify it into memory) while "
        "they generate, and pause only to swap it in. Lockstep: no actor resumes until every actor has swapped, so "
        "all of them serve one version at any time (an Update and a Resume command per actor). Rolling (backend "
        "filesystem only): each actor resumes as soon as it has swapped (one command per actor, the shortest "
        "pause), so for a moment actors serve different versions; each token still carries its version and "
        "spec.trainer.maxLag still bounds it. Either way status.weightsVersion is a version every actor serves.",
    )
    barrier_timeout_seconds: Annotated[int, Field(ge=1, le=86400)] = Field(
        600,
        description="How long each phase of a weight update may wait for its members' acks, in seconds.",
    )
    on_timeout: TimeoutAction = Field(
        TimeoutAction.FAIL_JOB,
        description="When a phase times out: FailJob fails the job; EvictStraggler replaces the members that did "
        "not ack and goes on without them (they rejoin on the newest weights).",
    )


class Preflight(Model):
    enabled: bool = Field(
        False,
        description="Before training, a pod of its own (<job>-preflight-0, the actors' image) samples with the "
        "job's effective vLLM configuration and recomputes the tokens with the trainer's forward pass; over the "
        "ParityPolicy's mismatch budget, the job stops (ParityLocked=False, MismatchBudgetExceeded).",
    )
    prompts: Annotated[int, Field(ge=1, le=1024)] = Field(8, description="Prompts the preflight samples.")
    samples_per_prompt: Annotated[int, Field(ge=1, le=64)] = Field(
        4, description="Completions per prompt, each spec.trainer.rollout.maxTokens long."
    )


class Output(Model):
    """Where the trainer writes the trained model, servable (docs/observability.md): a Hugging Face directory (the
    config, the tokenizer files with the chat template, the generation config and safetensors shards) or, in a LoRA
    job, PEFT's adapter directory. Trainer rank 0 writes it from a published version, into a temporary directory
    beside the final one and then renames it, so that nothing half-written is ever under the final name."""

    path: Annotated[str, Field(min_length=2, max_length=1024, pattern=r"^/")] = Field(
        description="An absolute directory in the trainer pod, on a volume of spec.trainer.volumeMounts (e.g. a "
        "PersistentVolumeClaim): each write is its subdirectory v<version, 6 digits>, e.g. /models/out/v000100, "
        "which `vllm serve` takes as it is. status.output names the last one."
    )
    dtype: DType = Field(
        DType.BFLOAT16,
        description="The dtype of the written tensors (the trainer's master weights are fp32); auto: the base "
        "checkpoint's. Default: bfloat16.",
    )
    every_steps: Annotated[int, Field(ge=0)] = Field(
        0,
        description="Also write the model every this many steps, besides at the end of a successful job. 0 (the "
        "default): at the end only.",
    )
    merged: bool = Field(
        False,
        description="LoRA jobs (spec.trainer.lora): also write the base model with the adapter merged into it, in "
        "the subdirectory merged/ of each write, a whole Hugging Face model. Default: false, the adapter alone.",
    )


RLJOB_NAME_MAX = 45
RLJOB_NAME_RULE = cel(
    f"size(self.metadata.name) <= {RLJOB_NAME_MAX}",
    f"metadata.name: at most {RLJOB_NAME_MAX} characters, so that pod host names <name>-trainer-<rank> stay "
    "valid DNS labels (63 characters); choose a shorter name",
)
RLJOB_NAME_LABEL_RULE = cel(
    "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')",
    "metadata.name: lower-case letters, digits and '-', starting with a letter and ending with a letter or digit "
    "(no '.'), because the job's Services are named after it (<name>-actors) and a Service name is a DNS label; "
    "choose such a name",
)
RLJOB_NAME_RULES = (RLJOB_NAME_RULE, RLJOB_NAME_LABEL_RULE)

OUTPUT_VOLUME_RULE = cel(
    "!has(self.output) || (has(self.trainer.volumeMounts) && self.trainer.volumeMounts.exists(m, "
    "self.output.path == m.mountPath || self.output.path.startsWith(m.mountPath.endsWith('/') ? m.mountPath : "
    "m.mountPath + '/')))",
    "spec.output.path must be on a volume the trainer mounts: at or under the mountPath of one of "
    "spec.trainer.volumeMounts (e.g. a PersistentVolumeClaim mounted at /models); add the volume and its mount",
    field_path=".output.path",
)


LORA_BACKEND_RULE = cel(
    "!has(self.trainer.lora) || self.weightSync.backend == 'filesystem'",
    "spec.trainer.lora needs spec.weightSync.backend filesystem: each version of a LoRA job is an adapter file "
    "the actors read from spec.weightSync.volume, and the nccl and gloo transfers send every weight of the model; "
    "use backend filesystem with a volume, or remove spec.trainer.lora",
    field_path=".trainer.lora",
)


class NetworkIsolation(Model):
    """The NetworkPolicy the operator keeps for the job (``<job>-isolation``): who may connect to its pods."""

    enabled: bool = Field(
        True,
        description="Admit connections to the job's pods only from the job's own pods (any port: torch.distributed "
        "and the weight-transfer group use ephemeral ports), plus metricsFrom. Egress is not restricted. It needs "
        "a network plugin that enforces NetworkPolicy; kubelet probes are not affected.",
    )
    metrics_from: list[dict[str, Any]] = Field(
        default_factory=list,
        description="NetworkPolicy peers (podSelector, namespaceSelector, ipBlock) that may also reach the actors' "
        "HTTP port (vLLM's /metrics, beside /generate) and the trainer's metrics port, e.g. "
        "[{namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: monitoring}}}] for Prometheus.",
        json_schema_extra=OPAQUE_LIST,
    )


class RLJobSpec(Model):
    """An online RL job: vLLM rollout actors and a torch trainer, kept in lockstep by weight-update barriers."""

    model_config = ConfigDict(json_schema_extra=validations(LORA_BACKEND_RULE, OUTPUT_VOLUME_RULE))

    model: ModelSource = Field(
        description="The base model the actors serve and the trainer trains (immutable).",
        json_schema_extra=immutable("spec.model", "weights are trained from this base model"),
    )
    parity_policy: Annotated[str, Field(min_length=1)] | None = Field(
        None, description="ParityPolicy to apply; default: the cluster's default policy."
    )
    actors: ActorSpec = Field(description="The vLLM rollout servers (pods <job>-actor-<i>).")
    trainer: TrainerSpec = Field(description="The trainer (pods <job>-trainer-<rank>; rank 0 drives the rollouts).")
    weight_sync: WeightSync = Field(description="How each new weights version reaches the actors.")
    preflight: Preflight = Field(
        default_factory=Preflight, description="A train-inference parity check before training starts."
    )
    network_policy: NetworkIsolation = Field(default_factory=NetworkIsolation)
    output: Output | None = Field(
        None, description="Where the trainer writes the trained model, servable. Default: unset, nothing written."
    )
    suspend: bool = Field(
        False,
        description="True deletes the job's pods and keeps its status (not counted as a restart); false creates "
        "them again (e.g. Kueue admits the job).",
    )
    max_restarts: Annotated[int, Field(ge=0)] = Field(
        3,
        description="Failures (pods that failed or vanished) the job survives; one more fails it. Replacements the "
        "operator chooses are not counted.",
    )
    ttl_seconds_after_finished: Annotated[int, Field(ge=0)] | None = Field(
        None, description="Seconds after the job succeeded or failed when it is deleted. Unset: never."
    )


# -- the barrier in the status (the wire documents are in lockstep.protocol) ------------------


class BarrierStatus(Model):
    """The open barrier, as recorded in ``RLJob.status.barrier``."""

    id: str = Field(
        description="<job uid>/<version>/<n>: names the barrier in every command and ack; n counts the barriers "
        "opened over the job's life (status.barriersOpened), so no two barriers of a job share an id"
    )
    version: int = Field(description="the weights version being loaded")
    attempt: int = Field(
        1, description="collective backends: the attempt at this version's transfer (a retry is a new barrier)"
    )
    uri: str = Field(description="where the weights are (a directory on the shared volume, or a manifest URL)")
    digest: str = Field(description="sha256 of the weights, checked by every member")
    bytes: int | None = Field(None, description="the version's size in bytes, as the trainer announced it")
    phase: BarrierPhase = Field(description="Pause, Update or Resume: what the members are asked to do now")
    members: dict[str, str] = Field(description="pod name → pod UID")
    sender: str | None = Field(
        None, description="collective backends: the member that sends the weights (trainer rank 0), rank 0 of the group"
    )
    started_at: str = Field(description="when the barrier opened (RFC 3339)")
    phase_started_at: str = Field(description="when the current phase began (RFC 3339)")
    deadline: str = Field(description="when the current phase times out")
    phase_seconds: dict[str, float] = Field(default_factory=dict, description="phase → how long it took, in seconds")
    slowest: dict[str, str] = Field(default_factory=dict, description="phase → the last member to ack it")
    evicted: list[str] = Field(default_factory=list, description="members evicted as stragglers (onTimeout)")
    reported: dict[str, str] = Field(default_factory=dict, description="pod → invalid ack already reported")
    transfer_ranks: dict[str, int] = Field(
        default_factory=dict,
        description="collective backends, from the Update phase on: member → its first rank in the transfer group",
    )
    transfer_world_size: int | None = Field(
        None, description="collective backends, from the Update phase on: ranks in the transfer group"
    )
    retries: dict[str, int] = Field(
        default_factory=dict, description="member → how often the current phase was asked again after an error"
    )

    def weights(self) -> Weights:
        return Weights(version=self.version, uri=self.uri, digest=self.digest, bytes=self.bytes)

    def command(self, member: str) -> Command:
        """The command for ``member``: its rank in the transfer group, when it has one, in the Update phase."""
        group = None
        if self.phase is BarrierPhase.UPDATE and member in self.transfer_ranks and self.transfer_world_size:
            group = TransferGroup(rank_offset=self.transfer_ranks[member], world_size=self.transfer_world_size)
        return Command(
            id=self.id,
            version=self.version,
            uri=self.uri,
            digest=self.digest,
            phase=self.phase,
            group=group,
            retry=self.retries.get(member, 0),
        )


class BarrierOutcome(StrEnum):
    COMPLETED = "Completed"
    FAILED = "Failed"
    INTERRUPTED = "Interrupted"


class BarrierRecord(Model):
    """One finished barrier, kept in ``RLJob.status.barrierHistory``."""

    id: str = Field(description="<job uid>/<version>")
    version: int = Field(description="the weights version the barrier loaded")
    outcome: BarrierOutcome = Field(
        description="Completed: every member serves the version; Failed: none committed; Interrupted: the job's pods "
        "were stopped (queued, preempted or suspended) while it was open, none committed"
    )
    seconds: float = Field(description="from opening to closing, in seconds")
    phase_seconds: dict[str, float] = Field(description="phase → how long it took, in seconds")
    slowest_pod: str | None = Field(None, description="the member that acked the longest phase last")
    members: int = Field(description="how many pods took part")
    bytes: int | None = Field(None, description="the version's size in bytes, as the trainer announced it")
    evicted: list[str] = Field(default_factory=list, description="members evicted as stragglers")
    reason: str | None = Field(
        None,
        description="why an interrupted barrier closed: Suspended, QuotaExceeded, or Kueue's reason (Preempted...)",
    )
    finished_at: str | None = Field(None, description="when the barrier closed (RFC 3339)")
    error: str | None = Field(
        None, description="why a failed barrier failed: the members' errors, or the transfer's, in words"
    )


class ConditionStatus(StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class Condition(Model):
    """A metav1.Condition."""

    type: str = Field(description="Ready, ParityLocked, ParityDegraded, Queued, Reconciling or Stalled")
    status: ConditionStatus = Field(description="True, False or Unknown")
    reason: str = Field(description="why, in one CamelCase word")
    message: str = Field("", description="why, for people")
    last_transition_time: str = Field(description="when status last changed (RFC 3339)")
    observed_generation: int | None = Field(None, description="the metadata.generation the condition describes")


class Phase(StrEnum):
    PENDING = "Pending"
    RUNNING = "Running"
    SUSPENDED = "Suspended"
    QUEUED = "Queued"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


class ReplicaStatus(Model):
    desired: int = Field(0, description="pods the spec asks for")
    ready: int = Field(0, description="of them, pods that are ready")
    summary: str = Field("0/0", description="ready/desired, for kubectl get.")


class QueueStatus(Model):
    """Where Kueue holds the job: a job labelled kueue.x-k8s.io/queue-name, with the operator's Kueue integration on."""

    local_queue: str = Field(description="The LocalQueue the job waits in (its label kueue.x-k8s.io/queue-name).")
    workload: str | None = Field(
        None, description="The job's Kueue Workload: one gang of its actor, trainer and preflight pods."
    )
    cluster_queue: str | None = Field(None, description="The ClusterQueue that admitted the Workload, while admitted.")


class RLJobStatus(Model):
    """What the operator observed and did: pods, committed weights, the barrier in flight, parity."""

    phase: Phase = Field(
        Phase.PENDING, description="Pending, Running, Suspended, Queued (waiting for Kueue), Succeeded or Failed."
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        description="Ready, ParityLocked, ParityDegraded, Queued (Kueue), and for kstatus Reconciling and Stalled.",
    )
    queue: QueueStatus | None = Field(None, description="Where Kueue holds the job (jobs Kueue manages only).")
    observed_generation: int | None = Field(None, description="The metadata.generation the status describes.")
    actors: ReplicaStatus = Field(
        default_factory=ReplicaStatus,
        description="The actor pods; with spec.actors.group the groups, a group ready when its leader is (its "
        "engine serves only once every rank of it runs).",
    )
    actor_pods: ReplicaStatus | None = Field(
        None, description="With spec.actors.group: every pod of the groups, leaders and workers. Unset otherwise."
    )
    trainer: ReplicaStatus = Field(default_factory=ReplicaStatus, description="The trainer pods.")
    weights_version: int | None = Field(None, description="The version every member serves (last barrier).")
    weights: Weights | None = Field(None, description="The committed weights; new pods start from them.")
    lag: int | None = Field(None, description="Newest announced version minus the oldest version an actor serves.")
    barrier: BarrierStatus | None = Field(None, description="The weight update in flight.")
    barrier_history: list[BarrierRecord] = Field(default_factory=list, description="The most recent barriers.")
    barriers_opened: int = Field(
        0, description="Barriers opened over the job's life: the last part of the newest barrier's id."
    )
    mismatch: Mismatch | None = Field(None, description="The trainer's last parity measurement.")
    evaluation: EvalResult | None = Field(None, description="The trainer's last evaluation (spec.trainer.eval).")
    output: OutputResult | None = Field(None, description="The trained model the trainer wrote last (spec.output).")
    preflight: PreflightResult | None = Field(None, description="The preflight parity check's result.")
    config_fingerprint: str | None = Field(
        None, description="sha256 of the effective configuration, also on every pod (a pod that differs is drift)."
    )
    parity_policy: str | None = Field(None, description="The ParityPolicy that was applied.")
    restarts: int = Field(0, description="Failures: pods that failed or vanished (counted against spec.maxRestarts).")
    replacements: int = Field(
        0,
        description="Pods the operator replaced by choice: spec edits, ParityPolicy changes, drift and straggler "
        "evictions (never counted against spec.maxRestarts).",
    )
    replacing: list[str] = Field(
        default_factory=list, description="Pods the operator deleted to replace them, not yet recreated."
    )
    restarting: list[str] = Field(
        default_factory=list,
        description="Pods lost in the restart under way (failed or vanished, and the trainer ranks restarted with "
        "them), not yet recreated: a further loss before they are back joins that restart.",
    )
    refused_announcement: str | None = Field(
        None, description="The trainer's last weights announcement the operator refused (reported once as an Event)."
    )
    last_restart_time: str | None = Field(None, description="When the operator last restarted failed pods (RFC 3339).")
    finished_time: str | None = Field(None, description="When the job succeeded or failed (RFC 3339).")


class RLJob(Model):
    api_version: str = API_VERSION
    kind: str = "RLJob"
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: RLJobSpec
    status: RLJobStatus | None = None
