"""How the trainer samples and scores: spec.trainer.rollout (with DAPO's overlong handling and dynamic sampling),
the prompts' dataset, evaluation, and the reward functions."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import ConfigDict, Field

from lockstep.api.shared import cel, validations
from lockstep.schema import Model

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
        "gradient, under the grpo, dr_grpo and rloo estimators; under reinforce_plus_plus, which has no group "
        "baseline, it has one, and is dropped all the same) is dropped, and another prompt of the step's is "
        "sampled in its place, until the step has promptsPerStep groups with signal or has sampled "
        "maxExtraGroups more (step metrics dropped_groups, extra_groups and unfilled_groups). Each step then "
        "draws promptsPerStep + maxExtraGroups prompts from the dataset (or the prompt source) and samples the "
        "extra ones only as needed; those it does not need are not sampled in that pass.",
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


class RewardErrorAction(StrEnum):
    ZERO = "Zero"
    FAIL = "Fail"


REWARD_NAME_PATTERN = r"^[a-z][a-z0-9_]*$"
MAX_REWARDS = 16
"""The most reward functions spec.trainer.rewards may list: bounded, as the lists CEL rules read must be."""


MAX_REWARD_WEIGHT = 1000.0
"""The largest size of a reward function's weight in spec.trainer.rewards."""


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
    weight: Annotated[float, Field(ge=-MAX_REWARD_WEIGHT, le=MAX_REWARD_WEIGHT)] = Field(
        1.0,
        description=f"What the function's reward is multiplied by in the sum, at most {MAX_REWARD_WEIGHT:g} in size: "
        "a larger weight is a typo or a reward in the wrong units (scale the function's own output instead); a "
        "weighted sum that overflows is a reward error (spec.trainer.onRewardError) naming the function.",
    )


UNIQUE_REWARD_NAMES_RULE = cel(
    "self.all(x, self.exists_one(y, y.name == x.name))",
    "spec.trainer.rewards: each reward function needs a name of its own, its step metric rewards/<name>",
    reason="FieldValueDuplicate",
)
