"""The trainer's model on each rank: built from the base model (fp32 master weights, spec.trainer.lora's adapter,
a KL reference), sharded (lockstep_workers.trainer.sharding), and restored from where the job left off: the newest
weights version its trainer published, with the newest checkpoint at or before it."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from lockstep.api import DType, TrainerNumerics, Training
from lockstep.podconfig import PodConfig
from lockstep.protocol import Weights
from lockstep_workers.trainer import checkpoint, optimization, sharding
from lockstep_workers.trainer.learner import Policy
from lockstep_workers.trainer.pod import (
    PodEnvironment,
    committed_weights,
)
from lockstep_workers.weights import lora
from lockstep_workers.weights.files import (
    newest_version,
    published,
    tensors,
    verified_path,
    version_path,
)

if TYPE_CHECKING:
    from peft import LoraConfig

logger = logging.getLogger("lockstep.trainer")


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
                check_adapter(version_path(env.weights_dir, decided[0].first_step - 1), model.adapter)
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


def check_adapter(path: Path, adapter: LoraConfig) -> None:
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
