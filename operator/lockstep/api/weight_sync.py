"""spec.weightSync: how each new weights version reaches the actors (the backend and its volume) and how they take it
(the update mode, the barrier's timeouts)."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any

from pydantic import ConfigDict, Field

from lockstep.api.shared import cel, immutable, validations
from lockstep.schema import OPAQUE_OBJECT, Model


class WeightSyncBackend(StrEnum):
    FILESYSTEM = "filesystem"
    NCCL = "nccl"
    GLOO = "gloo"

    @property
    def collective(self) -> bool:
        """True when the trainer sends the weights itself, as a member of every barrier."""
        return self is not WeightSyncBackend.FILESYSTEM


class TimeoutAction(StrEnum):
    FAIL_JOB = "FailJob"
    EVICT_STRAGGLER = "EvictStraggler"


class UpdateMode(StrEnum):
    """How the members of a weight update take a version (docs/barrier-protocol.md)."""

    LOCKSTEP = "Lockstep"
    ROLLING = "Rolling"


ROLLING_BACKEND_RULE = cel(
    "self.mode != 'Rolling' || self.backend == 'filesystem'",
    "spec.weightSync.mode Rolling needs backend filesystem: with nccl or gloo every member takes the weights in "
    "one transfer group at once; use mode Lockstep with them",
    field_path=".mode",
)

WEIGHTS_VOLUME_RULE = cel(
    "self.backend != 'filesystem' || has(self.volume)",
    "spec.weightSync.volume is required with backend filesystem: a volume every actor and trainer pod mounts, "
    "where the trainer writes weights and the actors read them, e.g. {persistentVolumeClaim: {claimName: weights}} "
    "(ReadWriteMany), or {hostPath: {path: /var/lib/lockstep}} when every pod runs on one node",
    field_path=".volume",
    reason="FieldValueRequired",
)


class WeightSync(Model):
    model_config = ConfigDict(json_schema_extra=validations(WEIGHTS_VOLUME_RULE, ROLLING_BACKEND_RULE))

    backend: WeightSyncBackend = Field(
        WeightSyncBackend.FILESYSTEM,
        description="How weights reach the actors. filesystem: the trainer writes safetensors files on "
        "spec.weightSync.volume and the actors read them. nccl (GPUs) or gloo (CPUs, over TCP): trainer rank 0 sends "
        "them into the actors' vLLM workers through vLLM's weight-transfer engine, in a process group formed for "
        "each weight update.",
        json_schema_extra=immutable("spec.weightSync.backend", "the actors and trainer were started for it"),
    )
    volume: dict[str, Any] | None = Field(
        None,
        description="A Kubernetes volume source (without a name), mounted in the job's pods (with nccl or gloo, in "
        "the trainer's only): the trainer writes weights and metrics.jsonl under <mount>/<job uid>/. Required with "
        "backend filesystem; with nccl or gloo it is optional and keeps the trainer's checkpoints across trainer "
        "restarts (without it they live in an emptyDir, and a trainer that lost its pod after weights were "
        "committed cannot resume).",
        json_schema_extra=OPAQUE_OBJECT,
    )
    mode: UpdateMode = Field(
        UpdateMode.LOCKSTEP,
        description="How the actors take each new version. Both stage it (read and verify it into memory) while "
        "they generate, and pause only to swap it in. Lockstep: no actor resumes until every actor has swapped, so "
        "all of them serve one version at any time (an Update and a Resume command per actor). Rolling (backend "
        "filesystem only): each actor resumes as soon as it has swapped (one command per actor, the shortest "
        "pause), so for a moment actors serve different versions; each token still carries its version and "
        "spec.trainer.maxLag still bounds it. Either way status.weightsVersion is a version every actor serves.",
    )
    barrier_timeout_seconds: Annotated[int, Field(ge=1, le=86400)] = Field(
        600,
        description="How long each phase of a weight update may wait for its members' acks, in seconds.",
    )
    on_timeout: TimeoutAction = Field(
        TimeoutAction.FAIL_JOB,
        description="When a phase times out: FailJob fails the job; EvictStraggler replaces the members that did "
        "not ack and goes on without them (they rejoin on the newest weights).",
    )
