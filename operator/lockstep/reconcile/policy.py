"""Step: the parity gate. The job's spec is read, its ParityPolicy chosen, and the effective vLLM configuration
computed; a job its policy refuses, or that has no usable policy, runs no new pods."""

from __future__ import annotations

from pydantic import ValidationError

from lockstep import environment
from lockstep.api import Enforcement, ParityPolicy, Phase, RLJobSpec
from lockstep.api.output import OUTPUT_PATH_WHY, USER_INFO_WHY, has_user_info
from lockstep.conditions import PARITY_LOCKED, READY
from lockstep.parity import EffectiveConfig, PolicyError, effective_config, select_policy
from lockstep.reconcile import summary
from lockstep.reconcile.context import Pass
from lockstep.reconcile.reasons import Reason


def valid_spec(run: Pass) -> RLJobSpec | None:
    """The job's spec, or None (Ready=False, InvalidSpec) when it does not parse, or when it takes over what the
    operator sets in its pods (``reserved_settings``: then its pods are deleted too)."""
    try:
        spec = RLJobSpec.model_validate(run.observed.job.get("spec") or {})
    except ValidationError as error:
        run.condition(READY, False, Reason.INVALID_SPEC, f"the RLJob spec is invalid: {error}")
        return None
    if problems := reserved_settings(spec):
        run.stop_all_pods(spec, "the job's env or mounts take over the operator's own")
        run.status.phase = Phase.PENDING
        message = f"the RLJob spec is invalid: {'; '.join(problems)}; no pods run until it is fixed"
        run.condition(READY, False, Reason.INVALID_SPEC, message)
        return None
    return spec


def reserved_settings(spec: RLJobSpec) -> list[str]:
    """Where the job's env, volumes or volumeMounts take over the operator's own, its env changes the workers'
    numerics or code or holds a credential not from a Secret (``lockstep.environment``), its tracking URI carries
    user info or its output path is not plain, in the CRD's words. The CRD refuses them; this stops a job that was
    created before it did, or past its admission."""
    problems = []
    for role, overrides in (("actors", spec.actors), ("trainer", spec.trainer)):
        for index, variable in enumerate(overrides.env or []):
            field = f"spec.{role}.env[{index}]"
            if environment.reserved_env(variable.name):
                problems.append(f"{field}.name: {variable.name}{environment.RESERVED_ENV_WHY}")
            if why := environment.locked_env_why(variable.name):
                problems.append(f"{field}.name: {variable.name}{why}")
            written = variable.model_dump(mode="json", by_alias=True, exclude_none=True)
            if environment.credential(variable.name) and not environment.from_secret(written):
                problems.append(f"{field}: {variable.name}{environment.CREDENTIAL_WHY}")
        for index, mount in enumerate(overrides.volume_mounts or []):
            if environment.reserved_volume(name := str(mount.get("name", ""))):
                field = f"spec.{role}.volumeMounts[{index}].name"
                problems.append(f"{field}: volume {name}{environment.RESERVED_VOLUME_MOUNT_WHY}")
            if environment.reserved_mount(path := str(mount.get("mountPath", ""))):
                field = f"spec.{role}.volumeMounts[{index}].mountPath"
                problems.append(f"{field}: mountPath {path}{environment.RESERVED_MOUNT_WHY}")
        for index, volume in enumerate(overrides.volumes or []):
            if environment.reserved_volume(name := str(volume.get("name", ""))):
                problems.append(f"spec.{role}.volumes[{index}].name: volume {name}{environment.RESERVED_VOLUME_WHY}")
    mlflow = spec.trainer.tracking.mlflow
    if mlflow is not None and mlflow.tracking_uri is not None and has_user_info(mlflow.tracking_uri):
        problems.append(f"spec.trainer.tracking.mlflow.trackingUri: trackingUri{USER_INFO_WHY}")
    if spec.output is not None and environment.unclean_path(spec.output.path):
        problems.append(f"spec.output.path: {spec.output.path}{OUTPUT_PATH_WHY}")
    return problems


def unlisted_env(spec: RLJobSpec, policy: ParityPolicy) -> list[str]:
    """The job's variables that are not on its list (``environment.allowed_env``: the documented ones, those under
    spec.envPrefix and those ``policy`` adds), each with UNLISTED_WHY. The locked ones are ``reserved_settings``'."""
    allowance = policy.spec.env
    return [
        f"spec.{role}.env[{index}].name: {variable.name}{environment.UNLISTED_WHY}"
        for role, overrides in (("actors", spec.actors), ("trainer", spec.trainer))
        for index, variable in enumerate(overrides.env or [])
        if not environment.reserved_env(variable.name)
        and environment.locked_env_why(variable.name) is None
        and not environment.allowed_env(
            variable.name, spec.env_prefix, tuple(allowance.names), tuple(allowance.prefixes)
        )
    ]


def resolve(run: Pass, spec: RLJobSpec) -> EffectiveConfig | None:
    """Set ParityLocked; the effective config, or None when the job may not run."""
    try:
        policies = [ParityPolicy.model_validate(p) for p in run.observed.policies]
        policy = select_policy(spec.parity_policy, policies, run.job.namespace, run.observed.namespace_labels)
    except PolicyError as error:
        message = str(error)
        if run.pods:
            message += (
                f"; the {len(run.pods)} existing pods keep running with the last applied configuration "
                f"({run.status.config_fingerprint}) and no new pods are created"
            )
        run.condition(PARITY_LOCKED, False, Reason(error.reason), message)
        run.condition(READY, False, Reason(error.reason), message)
        return None
    if unlisted := unlisted_env(spec, policy):
        run.stop_all_pods(spec, "the job sets variables that are not on its list")
        run.status.phase = Phase.PENDING
        message = f"the RLJob spec is invalid: {'; '.join(unlisted)}; no pods run until it is fixed"
        run.condition(READY, False, Reason.INVALID_SPEC, message)
        return None
    config = effective_config(spec, policy)
    run.status.parity_policy = config.policy
    conflicts = "; ".join(c.describe() for c in config.conflicts)
    if config.refused:
        refusals = []
        if config.conflicts:
            refusals.append(
                f"ParityPolicy {config.policy!r} (Enforce) locks keys this job sets otherwise: {conflicts}. "
                "Remove them from spec.actors.vllm or set them to the locked values"
            )
        refusals += [conflict.refusal(config.policy) for conflict in config.requirement_conflicts]
        message = f"{'. '.join(refusals)}; no pods run until then"
        run.stop_all_pods(spec, "the job conflicts with its ParityPolicy")
        run.status.phase = Phase.PENDING
        run.condition(PARITY_LOCKED, False, Reason.CONFLICTS_WITH_POLICY, message)
        run.condition(READY, False, Reason.CONFLICTS_WITH_POLICY, message)
        summary.count(run, spec, {})
        return None
    lora, replay = lora_report(config), routing_replay_report(config)
    requirements = [report for report in (lora, replay) if report is not None]
    if not config.conflicts and not requirements:
        run.condition(PARITY_LOCKED, True, Reason.LOCKED, f"vLLM settings locked by ParityPolicy {config.policy!r}")
    elif config.enforcement is Enforcement.WARN:
        parts = [f"overrode: {conflicts}; the pods run with the locked values"] if config.conflicts else []
        message = f"ParityPolicy {config.policy!r} (Warn) " + "; ".join(parts + requirements)
        # The vLLM settings are locked either way; the LoRA and routing replay requirements are what Warn cannot
        # apply.
        reason = (
            Reason.LORA_NOT_AS_POLICY_REQUIRES
            if lora
            else Reason.ROUTING_REPLAY_NOT_AS_POLICY_REQUIRES
            if replay
            else Reason.LOCKED_VALUES_APPLIED
        )
        run.condition(PARITY_LOCKED, True, reason, message)
    else:
        parts = (
            [f"records that this job differs: {conflicts}; the pods run with the job's own values"]
            if config.conflicts
            else []
        )
        message = f"ParityPolicy {config.policy!r} (Audit) " + "; ".join(parts + requirements)
        run.condition(PARITY_LOCKED, False, Reason.AUDIT_ONLY, message)
    run.status.config_fingerprint = config.fingerprint
    return config


def lora_report(config: EffectiveConfig) -> str | None:
    """How a job that a Warn or Audit policy admits breaks the policy's spec.lora, what it trains all the same, and
    the fix; None when it does not break it."""
    if config.lora_conflict is None:
        return None
    trains, fix = ("its adapter", "without") if config.lora is not None else ("every weight", "with")
    return (
        f"records that {config.lora_conflict.describe()}; the trainer trains {trains} all the same (a policy never "
        f"adds or drops an adapter); to comply, create the RLJob again {fix} spec.trainer.lora (it is immutable)"
    )


def routing_replay_report(config: EffectiveConfig) -> str | None:
    """How a job that a Warn or Audit policy admits breaks the policy's spec.routingReplay, what its actors do all
    the same, and the fix; None when it does not break it."""
    if config.routing_replay_conflict is None:
        return None
    if config.routing_replay:
        does, fix = "the actors replay their routing all the same", "set spec.actors.routingReplay to false"
    else:
        does = "the actors run without routing replay"
        fix = "create the RLJob again with spec.actors.group.pipelineParallelSize 1 (spec.actors.group is immutable)"
    return f"records that {config.routing_replay_conflict.describe()}; {does}; to comply, {fix}"
