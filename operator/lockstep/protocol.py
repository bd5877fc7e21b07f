"""The barrier protocol's wire documents (docs/barrier-protocol.md): what the operator, the trainer and
each pod's agent write in pod annotations, and how to write and read them; and the one exit code of the trainer
the operator reads. The operator and the agent both import this module, and nothing else of each other's.
"""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Annotated, Any, TypeVar

from pydantic import AfterValidator, Field, ValidationError

from lockstep.schema import OPAQUE_OBJECT, Model

INT64_MAX = 2**63 - 1
MAX_METRICS = 64
"""The most metrics a ``lockstep.dev/mismatch`` document may carry (the trainer announces the budget's, about 20)."""


def _int64(value: int) -> int:
    if value > INT64_MAX:
        raise ValueError(f"the number is beyond int64 (at most {INT64_MAX}), which the RLJob status cannot hold")
    return value


Count = Annotated[int, Field(strict=True, ge=0), AfterValidator(_int64)]
"""A count, a step or a version on the wire: a JSON integer from 0 to int64's largest (what the RLJob status, where
the operator copies it, can hold); never a bool, a float or a string."""
Version = Annotated[int, Field(strict=True, ge=1), AfterValidator(_int64)]
"""A weights version on the wire, counting from 1 (a Count otherwise)."""
Number = Annotated[float, Field(strict=True, allow_inf_nan=False)]
"""A measurement on the wire: a finite JSON number (an integer too); never NaN, Infinity, a bool or a string, which
the status could not hold (a JSON patch with NaN is invalid)."""
Fraction = Annotated[float, Field(strict=True, allow_inf_nan=False, ge=0, le=1)]
"""A finite number from 0 to 1."""
Magnitude = Annotated[float, Field(strict=True, allow_inf_nan=False, ge=0)]
"""A finite number from 0 up: a mean of absolute values, which a budget holds from above (a negative one would
read as within any budget)."""

TRAINER_GAVE_UP_EXIT_CODE = 3
"""The trainer's exit code when no restart can help: its optimiser steps had a gradient norm that is not finite too
many times in a row (NonFiniteGradients), and a restart would resume from the same committed weights. The operator
fails the job at once, quoting the trainer's termination message, rather than spend spec.maxRestarts on it (what a
Kubernetes Job's podFailurePolicy does with an onExitCodes rule whose action is FailJob)."""

PROTOCOL = 2
"""Version of the barrier protocol; every annotation document carries it. 2: a barrier opens in Update (pause,
then load) and has a Pause phase only while a retried transfer waits for its sender."""


class BarrierPhase(StrEnum):
    PAUSE = "Pause"
    UPDATE = "Update"
    RESUME = "Resume"


class Weights(Model):
    """Published weights: ``lockstep.dev/weights`` (trainer) and ``lockstep.dev/initial-weights`` (operator)."""

    protocol: int = Field(PROTOCOL, description="the barrier protocol version the document speaks")
    version: Version = Field(description="the weights version, counting from 1")
    uri: Annotated[str, Field(min_length=1)] = Field(
        description="where the weights are: a directory on the shared volume, or the trainer's manifest URL"
    )
    digest: Annotated[str, Field(min_length=1)] = Field(description="sha256:<hex> of the weights")
    bytes: Count | None = Field(
        None,
        description="the size of the version in bytes (its safetensors file): what an actor holds in host memory "
        "once more while it stages the version; unset by trainers that predate it (nothing is checked then)",
    )


class TransferGroup(Model):
    """A member's place in the process group that carries one barrier's weights (collective backends): the
    trainer is rank 0; an actor's vLLM workers take ranks ``rankOffset`` to ``rankOffset + workers - 1``."""

    rank_offset: int = Field(ge=0, description="the rank of this member's first vLLM worker in the group")
    world_size: int = Field(ge=2, description="ranks in the group: the trainer's one and every receiving worker's")


class Command(Model):
    """``lockstep.dev/barrier``: what the operator asks a member pod to do."""

    protocol: int = Field(PROTOCOL, description="the barrier protocol version the document speaks")
    id: str = Field(description="<job uid>/<version>: the barrier this command belongs to")
    version: int = Field(description="the weights version to load")
    uri: str = Field(description="where the weights are")
    digest: str = Field(description="sha256:<hex> the loaded weights must have")
    phase: BarrierPhase = Field(description="Pause, Update or Resume")
    group: TransferGroup | None = Field(
        None, description="collective backends, Update phase: this member's rank in the transfer group"
    )
    retry: int = Field(0, description="how often this phase was asked again of this member after it reported an error")


class MemberStep(StrEnum):
    """What a member does in a barrier, in this order: stage the version (generating still), pause, load it, resume."""

    STAGE = "stage"
    PAUSE = "pause"
    LOAD = "load"
    RESUME = "resume"


class StepTimes(Model):
    """When a member began and ended one step of a barrier, in seconds since the epoch (its own clock)."""

    start: Number = Field(description="when the step began")
    end: Number = Field(description="when it ended, done or failed")


class Ack(Model):
    """``lockstep.dev/barrier-ack``: what a pod says it has done."""

    protocol: int = Field(PROTOCOL, description="the barrier protocol version the document speaks")
    id: str | None = Field(None, description="the barrier the ack answers")
    phase: str = Field(description="Paused, Updated or Resumed: the phase done")
    loaded_version: int | None = Field(None, description="the weights version the pod's engine holds")
    digest: str | None = Field(None, description="sha256:<hex> of those weights")
    error: str | None = Field(None, description="why the phase failed on this pod; none when it succeeded")
    retry: int = Field(0, description="the retry of the command this ack answers")
    timings: dict[MemberStep, StepTimes] = Field(
        default_factory=dict,
        description="the steps this pod took in this barrier so far, a retried one at its last try; empty from "
        "agents that predate it (the operator's traces then have no span for the member)",
    )


class Mismatch(Model):
    """``lockstep.dev/mismatch``: the train-inference parity the trainer measured on its last step."""

    protocol: int = Field(PROTOCOL, description="the barrier protocol version the document speaks")
    step: Count = Field(description="the trainer step measured")
    mean_abs_logprob_diff: Magnitude = Field(
        description="mean |logprob_trainer - logprob_rollout| on sequences sampled wholly under the trainer's weights"
    )
    token_fraction: Fraction = Field(description="the fraction of the step's tokens that measurement covers")
    stale_samples_dropped: Count = Field(
        0,
        description="samples of the step dropped before the loss, and sampled again, because a token was more than "
        "spec.trainer.maxLag versions behind the trainer",
    )
    metrics: dict[str, Number] = Field(
        default_factory=dict,
        max_length=MAX_METRICS,
        description="the step's metrics a mismatch budget may name (lockstep.api.BudgetMetric, docs/corrections.md)",
    )


class EvalResult(Model):
    """``lockstep.dev/evaluation``: the trainer's last evaluation (spec.trainer.eval)."""

    protocol: int = Field(PROTOCOL, description="the barrier protocol version the document speaks")
    version: Count = Field(description="the weights version evaluated (the one its step started from)")
    reward: Number = Field(description="the mean reward of one greedy completion of each eval row")
    rows: Count = Field(description="how many eval rows were sampled")


class OutputResult(Model):
    """``lockstep.dev/output``: the trained model the trainer wrote last (spec.output), as a Hugging Face directory."""

    protocol: int = Field(PROTOCOL, description="the barrier protocol version the document speaks")
    path: str = Field(description="the directory written, in the trainer pod: spec.output.path/v<version, 6 digits>")
    version: Count = Field(description="the weights version written")
    step: Count = Field(description="the trainer step that published that version")
    eval_reward: Number | None = Field(
        None,
        description="the reward of the last evaluation before the write (spec.trainer.eval); none when no evaluation "
        "ran. An evaluation measures the version its step starts from: evalVersion says which",
    )
    eval_version: Count | None = Field(None, description="the weights version that evaluation measured")
    digest: str = Field(
        description="sha256:<hex> over the directory: each file's path and sha256, one line each, sorted "
        "(lockstep_workers.export.directory_digest)"
    )


class PreflightResult(Model):
    """``lockstep.dev/preflight``: what the preflight pod measured under the job's effective configuration."""

    protocol: int = Field(PROTOCOL, description="the barrier protocol version the document speaks")
    mean_abs_logprob_diff: Magnitude = Field(description="mean |logprob_trainer - logprob_rollout|, plain sampling")
    shared_prefix_mean_abs_logprob_diff: Magnitude = Field(
        description="the same, for requests that share a prompt with earlier ones, after an in-flight weight update"
    )
    clip_fraction: Number = Field(description="tokens whose ratio leaves [1 - 0.2, 1 + 0.2]")
    outside_top_p_per_thousand: Number = Field(description="tokens outside the trainer's top-p set, per 1000")
    tokens: Count = Field(description="tokens sampled and recomputed")
    engine_args: dict[str, Any] = Field(
        default_factory=dict,
        description="the vLLM engine arguments the job's settings were applied as, by vLLM's names",
        json_schema_extra=OPAQUE_OBJECT,
    )
    satisfied_by_construction: list[str] = Field(
        default_factory=list,
        description="settings not passed to vLLM because the vLLM in the image no longer has the behaviour they turn "
        "off (e.g. disableCascadeAttn: vLLM removed cascade attention)",
    )


ACK_FOR = {BarrierPhase.PAUSE: "Paused", BarrierPhase.UPDATE: "Updated", BarrierPhase.RESUME: "Resumed"}
"""The ack that answers each phase's command."""

DocumentT = TypeVar("DocumentT", Weights, Command, Ack, Mismatch, EvalResult, OutputResult, PreflightResult)


def document(value: Weights | Command | Ack | Mismatch | EvalResult | OutputResult | PreflightResult) -> str:
    """The annotation text of a protocol document."""
    return json.dumps(value.model_dump(mode="json", by_alias=True), sort_keys=True, separators=(",", ":"))


def read_document(text: str | None, kind: type[DocumentT]) -> DocumentT | str | None:
    """A protocol document from an annotation: the document, why it is unusable (naming the field), or None when
    absent. Numbers are strict (Count, Number): NaN, Infinity, integers beyond int64, negative counts, and bools or
    strings where numbers belong are refused, never coerced."""
    if text is None:
        return None
    try:
        value = kind.model_validate(json.loads(text))
    except ValidationError as error:
        return f"is not a valid {kind.__name__} document: {_first_problem(error)}"
    except ValueError as error:
        return f"is not a valid {kind.__name__} document (not JSON: {error})"
    if value.protocol != PROTOCOL:
        return f"speaks barrier protocol {value.protocol}; this version speaks {PROTOCOL}"
    return value


def _first_problem(error: ValidationError) -> str:
    """The first of ``error``'s problems, naming its field as written on the wire, e.g. ``metrics.ess: Input
    should be a finite number (got NaN)``; and how many more there are."""
    problems = error.errors()
    first = problems[0]
    where = ".".join(str(part) for part in first["loc"]) or "the document"
    got = json.dumps(first["input"], allow_nan=True, default=str) if "input" in first else ""
    shown = f" (got {got[:60]})" if got and first["type"] != "missing" else ""
    more = f"; and {len(problems) - 1} more" if len(problems) > 1 else ""
    return f"{where}: {first['msg'].removeprefix('Value error, ')}{shown}{more}"


def parse_ack(text: str | None) -> Ack | str | None:
    """The ack, why it is unusable, or None when there is none."""
    return read_document(text, Ack)
