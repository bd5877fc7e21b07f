"""The ParityPolicy kind: the vLLM settings and trainer numerics a cluster admin locks for the RLJobs of the selected
namespaces, the mismatch budget they may show, and the features they may, must or must not use."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any

from pydantic import ConfigDict, Field

from lockstep.api.actors import VllmSettings
from lockstep.api.pods import EnvAllowance
from lockstep.api.shared import API_VERSION, DType, cel, validations
from lockstep.schema import Model


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
    env: EnvAllowance = Field(
        default_factory=EnvAllowance,
        description="Variables the jobs of the selected namespaces may set in spec.actors.env and spec.trainer.env "
        "besides the documented ones (docs/security.md#environment) and those under their own spec.envPrefix. None "
        "may change the numbers the workers compute or the code they load (ONEDNN_*, TORCH*, NVIDIA_*, VLLM_*, LD_*, "
        "PATH, PYTHON*...): those no policy allows. Default: none.",
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
