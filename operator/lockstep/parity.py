"""Parity policy resolution: which ParityPolicy governs a job, and the effective
configuration that results from merging the job's vLLM settings with the locked ones.

Pure functions; the operator feeds them what it read from the API server.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from lockstep.api import (
    DType,
    Enforcement,
    LogprobsMode,
    MismatchBudget,
    ParityPolicy,
    ParityPolicySpec,
    Requirement,
    RLJobSpec,
    TrainerParity,
    VllmSettings,
    WeightUpdateSemantics,
)
from lockstep.protocol import PreflightResult

DEFAULT_POLICY_NAME = "default"


def default_policy() -> ParityPolicy:
    """The shipped default: the four backend fixes of docs/design.md, locked and enforced."""
    return ParityPolicy(
        metadata={"name": DEFAULT_POLICY_NAME},
        spec=ParityPolicySpec(
            default=True,
            enforcement=Enforcement.ENFORCE,
            vllm=VllmSettings(
                logprobs_mode=LogprobsMode.PROCESSED_LOGPROBS,
                enable_prefix_caching=False,
                async_scheduling=False,
                disable_cascade_attn=True,
                hf_overrides={"head_dtype": "float32"},
            ),
            trainer=TrainerParity(lm_head_dtype=DType.FLOAT32),
            weight_update=WeightUpdateSemantics(),
        ),
    )


AFTER_UPDATE_GROWTH = 10.0
"""How many times the plain sampling's mismatch the preflight tolerates after an in-flight update (with at least the
budget itself): a sound engine computes after an update about as it did before (measured on SmolLM2-135M-Instruct:
3.5x in bf16, 9x in fp16, 2.4x in fp32, 1.6x with a LoRA adapter), a stale head or a reused KV cache multiplies it
by 50 or more (docs/parity.md#budgets-that-hold-on-real-models). Relative, so that it holds in every dtype."""


def preflight_breach(result: PreflightResult, budget: float) -> str | None:
    """What of the preflight's ``result`` is over the mismatch ``budget`` (meanAbsLogprobDiff), in words; None when
    nothing: plain sampling within the budget, and after an in-flight update within the larger of the budget and
    AFTER_UPDATE_GROWTH times plain sampling's."""
    plain, after = result.mean_abs_logprob_diff, result.shared_prefix_mean_abs_logprob_diff
    if plain > budget:
        return f"plain sampling's mean |Δlogprob| {plain:.3g} is over the budget {budget:.3g}"
    bound = max(budget, AFTER_UPDATE_GROWTH * plain)
    if after > bound:
        return (
            f"after an in-flight update the mean |Δlogprob| is {after:.3g}, over {bound:.3g} (the larger of the budget "
            f"and {AFTER_UPDATE_GROWTH:g}x plain sampling's {plain:.3g}): the engine computes with something other "
            "than the new weights after an update (a stale head, a reused KV cache)"
        )
    return None


class PolicyError(ValueError):
    """No usable policy: ``reason`` is a condition reason, the message says what to do."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Conflict:
    """A key the job sets to something other than its locked value."""

    key: str
    requested: Any
    locked: Any

    def describe(self) -> str:
        return f"spec.actors.vllm.{self.key}={_show(self.requested)} (locked to {_show(self.locked)})"

    def refusal(self, policy: str) -> str:
        """The API server's words when an Enforce policy refuses it (the CEL in crds/admission-parity.yaml)."""
        return (
            f"spec.actors.vllm.{self.key}: ParityPolicy '{policy}' (Enforce) locks it to {_cel_show(self.locked)}; "
            "remove the key or set it to that value"
        )


@dataclass(frozen=True)
class LoraConflict:
    """The job trains a LoRA adapter where its policy forbids one, or none where its policy requires one."""

    requirement: Requirement
    """Required or Forbidden: what the policy's spec.lora says."""

    def describe(self) -> str:
        if self.requirement is Requirement.FORBIDDEN:
            return "spec.trainer.lora is set (the policy's spec.lora is Forbidden: full fine-tuning only)"
        return "spec.trainer.lora is not set (the policy's spec.lora is Required: LoRA jobs only)"

    def refusal(self, policy: str) -> str:
        """The API server's words when an Enforce policy refuses it (the CEL in crds/admission-parity.yaml)."""
        return lora_refusal(self.requirement, policy)


def lora_refusal(requirement: Requirement, policy: str) -> str:
    """Why an Enforce ParityPolicy named ``policy`` refuses a job over spec.trainer.lora, and the fix (the words of
    both the operator and the API server: admission.lora_validations renders them in CEL from this function)."""
    if requirement is Requirement.FORBIDDEN:
        return (
            f"spec.trainer.lora: ParityPolicy '{policy}' (Enforce) forbids LoRA adapters (its spec.lora is Forbidden); "
            "remove spec.trainer.lora to train every weight, or name a ParityPolicy whose spec.lora is Allowed"
        )
    return (
        f"spec.trainer.lora: ParityPolicy '{policy}' (Enforce) requires a LoRA adapter (its spec.lora is Required); "
        "set spec.trainer.lora (e.g. {rank: 16}, with spec.weightSync.backend filesystem), or name a ParityPolicy "
        "whose spec.lora is Allowed"
    )


def lora_conflict(spec: RLJobSpec, requirement: Requirement) -> LoraConflict | None:
    """Whether the job's spec.trainer.lora breaks the policy's spec.lora."""
    if requirement is Requirement.FORBIDDEN and spec.trainer.lora is not None:
        return LoraConflict(requirement)
    if requirement is Requirement.REQUIRED and spec.trainer.lora is None:
        return LoraConflict(requirement)
    return None


@dataclass(frozen=True)
class RoutingReplayConflict:
    """The job asks for routing replay where its policy forbids it, or cannot replay (pipeline parallelism) where
    its policy requires it."""

    requirement: Requirement
    """Required or Forbidden: what the policy's spec.routingReplay says."""

    def describe(self) -> str:
        if self.requirement is Requirement.FORBIDDEN:
            return "spec.actors.routingReplay is true (the policy's spec.routingReplay is Forbidden)"
        return (
            "spec.actors.group.pipelineParallelSize is above 1, with which vLLM cannot return the routed experts (the "
            "policy's spec.routingReplay is Required)"
        )

    def refusal(self, policy: str) -> str:
        """The API server's words when an Enforce policy refuses it (the CEL in crds/admission-parity.yaml)."""
        return routing_replay_refusal(self.requirement, policy)


def routing_replay_refusal(requirement: Requirement, policy: str) -> str:
    """Why an Enforce ParityPolicy named ``policy`` refuses a job over routing replay, and the fix (the words of both
    the operator and the API server: admission.routing_replay_validations renders them in CEL from this function)."""
    if requirement is Requirement.FORBIDDEN:
        return (
            f"spec.actors.routingReplay: ParityPolicy '{policy}' (Enforce) forbids routing replay (its "
            "spec.routingReplay is Forbidden); set spec.actors.routingReplay to false, or name a ParityPolicy whose "
            "spec.routingReplay is Allowed"
        )
    return (
        f"spec.actors.group.pipelineParallelSize: ParityPolicy '{policy}' (Enforce) requires routing replay (its "
        "spec.routingReplay is Required), which vLLM cannot do with pipeline parallelism; set "
        "spec.actors.group.pipelineParallelSize to 1, or name a ParityPolicy whose spec.routingReplay is Allowed"
    )


def routing_replay_conflict(spec: RLJobSpec, requirement: Requirement) -> RoutingReplayConflict | None:
    """Whether the job breaks the policy's spec.routingReplay."""
    if requirement is Requirement.FORBIDDEN and spec.actors.routing_replay:
        return RoutingReplayConflict(requirement)
    if requirement is Requirement.REQUIRED and not can_replay(spec):
        return RoutingReplayConflict(requirement)
    return None


def can_replay(spec: RLJobSpec) -> bool:
    """Whether vLLM can return the routed experts for the job's actors: not with pipeline parallelism."""
    return spec.actors.group is None or spec.actors.group.pipeline_parallel_size == 1


def replays(spec: RLJobSpec, requirement: Requirement) -> bool:
    """Whether the job's actors return the routed experts: the job asks for it, or its policy requires it and the
    job can (a Forbidden policy never turns a job's replay off: it refuses the job under Enforce, and reports it
    otherwise)."""
    return spec.actors.routing_replay or (requirement is Requirement.REQUIRED and can_replay(spec))


REPLAY_VLLM = {"enablePrefixCaching": True}
"""What routing replay needs of vLLM's settings, over whatever the policy locks: vLLM returns the routed experts only
with prefix caching."""
REPLAY_WEIGHT_UPDATE = {"clearCache": True}
"""What routing replay needs of a weight update, over the policy's: with prefix caching on, an update must clear the
cache, or requests reuse KV computed under the old weights (api.PREFIX_CACHE_RULE)."""


@dataclass(frozen=True)
class EffectiveConfig:
    """What the pods of a job run with, and the sha256 fingerprint stamped on them."""

    policy: str
    enforcement: Enforcement
    vllm: dict[str, Any]
    trainer: dict[str, Any]
    mismatch_budget: MismatchBudget
    """Not part of the fingerprint: changing a budget changes no pod."""
    weight_update: dict[str, Any]
    model: dict[str, Any]
    conflicts: list[Conflict] = field(default_factory=list)
    lora: dict[str, Any] | None = None
    """spec.trainer.lora, by its API names; None for a job that trains every weight."""
    lora_conflict: LoraConflict | None = None
    """How the job breaks its policy's spec.lora, if it does (a policy can neither add nor drop an adapter)."""
    routing_replay: bool = False
    """Whether the actors return the routed experts (``replays``); then ``vllm`` has prefix caching on and
    ``weight_update`` clears the cache."""
    routing_replay_conflict: RoutingReplayConflict | None = None
    """How the job breaks its policy's spec.routingReplay, if it does."""
    env: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    """The job's own env of each role that sets one (``job_env``), as written."""

    @functools.cached_property
    def fingerprint(self) -> str:
        """sha256 of the document (computed once: every desired pod of every pass carries it)."""
        canonical = json.dumps(self.document(), sort_keys=True, separators=(",", ":"))
        return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()

    @functools.cached_property
    def vllm_settings(self) -> VllmSettings:
        """``vllm`` as its model, from which the actors' flags are rendered (lockstep.podconfig.actor_args)."""
        return VllmSettings.model_validate(self.vllm)

    def document(self) -> dict[str, Any]:
        """The part that determines parity (written to the job's ConfigMap). ``lora`` only for a LoRA job and
        ``routingReplay`` only for a replaying one, and ``env`` only for a job that sets variables of its own, so that
        the fingerprint of a job with none of them is what it was before they existed."""
        document: dict[str, Any] = {
            "model": self.model,
            "vllm": self.vllm,
            "trainer": self.trainer,
            "weightUpdate": self.weight_update,
        }
        if self.lora is not None:
            document["lora"] = self.lora
        if self.routing_replay:
            document["routingReplay"] = True
        if self.env:
            document["env"] = self.env
        return document

    @property
    def requirement_conflicts(self) -> list[LoraConflict | RoutingReplayConflict]:
        """How the job breaks its policy's spec.lora and spec.routingReplay, in that order."""
        return [c for c in (self.lora_conflict, self.routing_replay_conflict) if c is not None]

    @property
    def refused(self) -> bool:
        return bool(self.conflicts or self.requirement_conflicts) and self.enforcement is Enforcement.ENFORCE

    def refusals(self) -> list[str]:
        """The API server's words for each conflict, were the policy Enforce (the vLLM keys first, as it checks)."""
        words = [conflict.refusal(self.policy) for conflict in self.conflicts]
        return words + [conflict.refusal(self.policy) for conflict in self.requirement_conflicts]

    def differences(self) -> list[str]:
        """Each conflict, described (the vLLM keys first)."""
        return [conflict.describe() for conflict in [*self.conflicts, *self.requirement_conflicts]]


def _cel_show(value: Any) -> str:
    """A value as CEL's string() writes it: false, 0.5, processed_logprobs, {head_dtype: float32}."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_cel_show(v)}" for k, v in value.items()) + "}"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _show(value: Any) -> str:
    return json.dumps(value) if not isinstance(value, str) else value


def select_policy(
    requested: str | None, policies: list[ParityPolicy], namespace: str, namespace_labels: dict[str, str]
) -> ParityPolicy:
    """The policy a job in ``namespace`` uses: the one it names, else the single default policy."""
    if requested:
        chosen = next((p for p in policies if p.metadata.get("name") == requested), None)
        if chosen is None:
            raise PolicyError(
                "PolicyNotFound",
                f"spec.parityPolicy: ParityPolicy {requested!r} does not exist; create it or name an existing one "
                "(kubectl get paritypolicies)",
            )
    else:
        defaults = sorted(p.metadata.get("name", "") for p in policies if p.spec.default)
        if not defaults:
            raise PolicyError(
                "NoDefaultPolicy",
                "spec.parityPolicy is not set and no ParityPolicy has spec.default: true; set spec.parityPolicy, "
                "or install the default policy (crds/default-paritypolicy.yaml)",
            )
        if len(defaults) > 1:
            raise PolicyError(
                "AmbiguousDefaultPolicy",
                f"spec.parityPolicy is not set and {len(defaults)} ParityPolicies are marked default "
                f"({', '.join(defaults)}); set spec.default: true on only one, or set spec.parityPolicy",
            )
        chosen = next(p for p in policies if p.metadata.get("name") == defaults[0])
    selector = chosen.spec.namespace_selector.match_labels
    if any(namespace_labels.get(key) != value for key, value in selector.items()):
        raise PolicyError(
            "PolicyNotApplicable",
            f"ParityPolicy {chosen.metadata.get('name')!r} does not apply to namespace {namespace!r} "
            f"(its namespaceSelector needs labels {selector}); label the namespace or choose another policy",
        )
    return chosen


def settings_dict(settings: VllmSettings) -> dict[str, Any]:
    """The keys that are set, by their API (camelCase) names."""
    return settings.model_dump(mode="json", by_alias=True, exclude_none=True)


def effective_config(spec: RLJobSpec, policy: ParityPolicy) -> EffectiveConfig:
    """Merge the job's vLLM settings with the policy's locked ones.

    Under Enforce and Warn the locked value wins; under Audit the job's value is kept. Either way every
    differing key is reported as a conflict, so the caller can refuse, warn or record. A job that replays its
    routing (``replays``) gets prefix caching and a weight update that clears the cache, whatever the policy locks.
    """
    requested = settings_dict(spec.actors.vllm)
    locked = settings_dict(policy.spec.vllm)
    conflicts = [
        Conflict(key, requested[key], value)
        for key, value in locked.items()
        if key in requested and requested[key] != value
    ]
    vllm = {**locked, **requested} if policy.spec.enforcement is Enforcement.AUDIT else {**requested, **locked}
    weight_update = policy.spec.weight_update.model_dump(mode="json", by_alias=True)
    replay = replays(spec, policy.spec.routing_replay)
    if replay:  # what replay needs wins over the policy's locks: the one place they are overridden
        vllm |= REPLAY_VLLM
        weight_update |= REPLAY_WEIGHT_UPDATE
    return EffectiveConfig(
        policy=policy.metadata.get("name", ""),
        enforcement=policy.spec.enforcement,
        vllm=dict(sorted(vllm.items())),
        trainer=policy.spec.trainer.model_dump(mode="json", by_alias=True, exclude={"mismatch_budget"}),
        mismatch_budget=policy.spec.trainer.mismatch_budget,
        weight_update=weight_update,
        model=spec.model.model_dump(mode="json", by_alias=True),
        conflicts=conflicts,
        lora=None if spec.trainer.lora is None else spec.trainer.lora.model_dump(mode="json", by_alias=True),
        lora_conflict=lora_conflict(spec, policy.spec.lora),
        routing_replay=replay,
        routing_replay_conflict=routing_replay_conflict(spec, policy.spec.routing_replay),
        env=job_env(spec),
    )


def job_env(spec: RLJobSpec) -> dict[str, list[dict[str, Any]]]:
    """Role (actors, trainer) → the variables the job sets on its pods, as written: a value, or where it comes from
    (a Secret's name and key, never its value). The preflight runs with the actors' env."""
    roles = {"actors": spec.actors.env, "trainer": spec.trainer.env}
    return {
        role: [variable.model_dump(mode="json", by_alias=True, exclude_none=True) for variable in env]
        for role, env in roles.items()
        if env
    }
