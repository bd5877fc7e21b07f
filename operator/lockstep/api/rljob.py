"""The RLJob kind: its spec, made of the other files' parts (the base model, the actors, the trainer, weight sync, the
output), the preflight, network isolation, and the CEL rules across them."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import ConfigDict, Field

from lockstep.api.actors import ActorSpec
from lockstep.api.output import Output
from lockstep.api.pods import EnvPrefix
from lockstep.api.shared import API_VERSION, DType, cel, immutable, validations
from lockstep.api.status import RLJobStatus
from lockstep.api.trainer import TrainerSpec
from lockstep.api.weight_sync import WeightSync
from lockstep.schema import OPAQUE_LIST, Model


class ModelSource(Model):
    uri: Annotated[str, Field(min_length=1)] = Field(description="Path in the pod, or a URI, of the base model.")
    dtype: DType = Field(
        DType.BFLOAT16,
        description="The dtype the trainer computes the model's layers in (auto: the checkpoint's). Keep "
        "spec.actors.vllm.dtype the same, so that both sides compute alike.",
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
    env_prefix: EnvPrefix | None = Field(
        None,
        description="The prefix of the variables the job's own code reads (its reward function, a custom image), "
        "e.g. APP_: spec.actors.env and spec.trainer.env may set any variable under it, besides the documented ones "
        "(docs/security.md#environment) and those the ParityPolicy adds. It may reach no variable that changes the "
        "numbers the workers compute or the code they load. Default: unset, the documented variables only.",
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


class RLJob(Model):
    api_version: str = API_VERSION
    kind: str = "RLJob"
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: RLJobSpec
    status: RLJobStatus | None = None
