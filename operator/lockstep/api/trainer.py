"""spec.trainer: what the trainer process runs (Training, passed to it as it is), a LoRA adapter, and the trainer's
pods (TrainerSpec), with the CEL rules across their fields."""

from __future__ import annotations

from typing import Annotated

from pydantic import ConfigDict, Field

from lockstep.api.objective import Objective
from lockstep.api.output import Tracking
from lockstep.api.pods import MAX_NAME_LENGTH, PodOverrides
from lockstep.api.rollout import (
    CALLABLE_PATTERN,
    MAX_REWARDS,
    UNIQUE_REWARD_NAMES_RULE,
    Dataset,
    Evaluation,
    RewardErrorAction,
    RolloutSettings,
    WeightedReward,
)
from lockstep.api.shared import cel, validations
from lockstep.schema import Model

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
