"""spec.actors: the vLLM rollout servers, the engine arguments they run with (VllmSettings, which a ParityPolicy
also locks), and a group of pods sharing one engine (ActorGroup)."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import ConfigDict, Field

from lockstep.api.pods import PodOverrides
from lockstep.api.shared import DType, cel, validations
from lockstep.schema import Model


class LogprobsMode(StrEnum):
    RAW_LOGPROBS = "raw_logprobs"
    RAW_LOGITS = "raw_logits"
    PROCESSED_LOGPROBS = "processed_logprobs"
    PROCESSED_LOGITS = "processed_logits"


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
