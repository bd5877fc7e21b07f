"""The operator-to-pod contract: the job's effective configuration as its pods read it (``PodConfig``), and the
actor's command line. The operator renders both (lockstep.desired: the job's ConfigMap, the actor pods' args); the
actor, the trainer and the preflight read them with ``load_pod_config`` and ``parse_actor_args``, and nothing else.

It sits beside protocol.py, not in it: protocol.py's documents are part of the RLJob's status (api/status.py
imports them), and a PodConfig is made of lockstep.api's models.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args, get_origin

from pydantic import Field, ValidationError

from lockstep import environment
from lockstep.api import (
    ActorGroup,
    MismatchBudget,
    ModelSource,
    Output,
    TrainerNumerics,
    Training,
    VllmSettings,
    WeightUpdateSemantics,
)
from lockstep.schema import Model


class PodConfig(Model):
    """The job's effective configuration: the JSON file at ``$LOCKSTEP_CONFIG`` in each of its pods (key
    ``effective-config.json`` of its ConfigMap). The pods' ``lockstep.dev/config-fingerprint`` covers ``model``,
    ``vllm``, ``trainer``, ``weightUpdate``, in a LoRA job ``training.lora``, in a replaying job ``routingReplay``
    and in a job with variables of its own ``env`` (lockstep.parity.EffectiveConfig.document)."""

    fingerprint: str = Field(description="sha256 of the parity part of this configuration, as each pod carries it")
    policy: str = Field(description="the ParityPolicy this configuration comes from")
    model: ModelSource = Field(description="spec.model")
    vllm: VllmSettings = Field(
        description="the actors' vLLM settings: the job's, merged with the policy's locked ones (the actors get them "
        "as flags, actor_args; the preflight reads them here)"
    )
    trainer: TrainerNumerics = Field(description="what the trainer computes like the actors (the policy's)")
    weight_update: WeightUpdateSemantics = Field(
        description="how an actor takes new weights (the policy's; with routing replay, clearing the cache)"
    )
    routing_replay: bool = Field(
        False,
        description="whether the actors return the experts each token was routed to (spec.actors.routingReplay, or "
        "the policy's Required), with each sample, for the trainer to replay in its MoE layers "
        "(lockstep_workers.trainer.routing); vllm then has prefix caching on",
    )
    env: dict[str, list[dict[str, Any]]] | None = Field(
        None,
        description="the variables the job sets on its pods (spec.actors.env, spec.trainer.env), by role, as written "
        "(a Secret's name and key, never its value)",
    )
    mismatch_budget: MismatchBudget = Field(
        description="the policy's budget; not part of the fingerprint: changing it changes no pod"
    )
    training: Training = Field(description="spec.trainer's training fields: what the trainer runs")
    output: Output | None = Field(None, description="spec.output: where the trainer writes the trained model")

    def text(self) -> str:
        """The ConfigMap's JSON, read by ``load_pod_config`` (unset fields left out)."""
        return json.dumps(self.model_dump(mode="json", by_alias=True, exclude_none=True), indent=2, sort_keys=True)


def load_pod_config(environ: Mapping[str, str]) -> PodConfig | None:
    """The PodConfig at ``$LOCKSTEP_CONFIG``, or None where the variable is unset (a worker run outside an RLJob).
    Exits, naming the file and each field it cannot read, when the file is not a PodConfig."""
    path = environ.get(environment.CONFIG)
    if not path:
        return None
    try:
        return PodConfig.model_validate_json(Path(path).read_text())
    except OSError as error:
        raise SystemExit(
            f"{environment.CONFIG}: {path} cannot be read ({error.strerror or error}); the operator mounts the job's "
            f"configuration at {environment.CONFIG_PATH}: run the worker as the operator renders its pod"
        ) from None
    except ValidationError as error:
        raise SystemExit(
            f"{environment.CONFIG}: {path} is not a Lockstep pod configuration ({_fields(error)}); the operator and "
            "this worker image are of different Lockstep versions: run the worker image of the operator's version"
        ) from None


@dataclass(frozen=True)
class ActorArgs:
    """The actor's command line: what ``parse_actor_args`` reads back from ``actor_args``."""

    model: str
    port: int
    vllm: VllmSettings
    group: ActorGroup | None = None
    """spec.actors.group: how the engine is split over the pods of the actor's group; None, one pod."""


def actor_args(model: str, port: int, settings: VllmSettings, group: ActorGroup | None = None) -> list[str]:
    """The actor's arguments: ``--model``, ``--port``, ``vllm_flags(settings)`` and, for a group's pods (the leader's
    actor and the workers' lockstep_workers.actor.headless alike), ``--group`` with its JSON."""
    split = [f"--group={group.model_dump_json(by_alias=True)}"] if group is not None else []
    return [f"--model={model}", f"--port={port}", *vllm_flags(settings), *split]


def vllm_flags(settings: VllmSettings) -> list[str]:
    """The settings that are set, as ``vllm serve``-style flags in the order of their names: ``--max-model-len=512``,
    ``--no-enable-prefix-caching``, ``--hf-overrides={"head_dtype":"float32"}``."""
    args = []
    for key, value in sorted(settings.model_dump(mode="json", by_alias=True, exclude_none=True).items()):
        flag = _flag(key)
        if isinstance(value, bool):
            args.append(flag if value else f"--no-{flag[2:]}")
        elif isinstance(value, dict):
            args.append(f"{flag}={json.dumps(value, sort_keys=True, separators=(',', ':'))}")
        else:
            args.append(f"{flag}={value}")
    return args


def parse_actor_args(args: Sequence[str] | None = None) -> ActorArgs:
    """The actor's command line (``sys.argv`` when ``args`` is None), as ``actor_args`` renders it; exits naming
    the flag that does not fit its setting."""
    parser = argparse.ArgumentParser(
        prog="python -m lockstep_workers.actor",
        description="The rollout actor: vLLM V1, with the flags lockstep.podconfig.actor_args renders.",
    )
    parser.add_argument("--model", required=True, help="path of the model to serve")
    parser.add_argument("--port", type=int, default=environment.ACTOR_PORT)
    parser.add_argument("--group", type=_group, help="spec.actors.group, as JSON")
    for name, field in VllmSettings.model_fields.items():
        flag = _flag(field.alias or name)
        kinds = {get_origin(kind) or kind for kind in get_args(field.annotation) or (field.annotation,)}
        if bool in kinds:
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction)
        elif dict in kinds:
            parser.add_argument(flag, dest=name, type=json.loads)
        else:
            parser.add_argument(flag, dest=name)
    options = parser.parse_args(args)
    given = {
        field.alias or name: value
        for name, field in VllmSettings.model_fields.items()
        if (value := getattr(options, name)) is not None
    }
    try:
        settings = VllmSettings.model_validate(given)
    except ValidationError as error:
        parser.error(_fields(error, _flag))
    return ActorArgs(options.model, options.port, settings, options.group)


def _group(text: str) -> ActorGroup:
    """``--group``'s JSON, or an argparse error naming each field that does not fit."""
    try:
        return ActorGroup.model_validate_json(text)
    except ValidationError as error:
        raise argparse.ArgumentTypeError(f"not a spec.actors.group ({_fields(error)})") from None


def _flag(name: str) -> str:
    """A camelCase setting's flag: maxModelLen → --max-model-len."""
    return "--" + "".join("-" + c.lower() if c.isupper() else c for c in name)


def _fields(error: ValidationError, spell: Callable[[str], str] = str) -> str:
    """Each field a ValidationError names (spelled by ``spell``), with what is wrong with it."""
    return "; ".join(f"{spell('.'.join(map(str, p['loc'])))}: {p['msg']}" for p in error.errors())
