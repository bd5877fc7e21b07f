"""What the trainer leaves behind: experiment tracking of its run (spec.trainer.tracking) and the trained model,
servable (spec.output)."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import ConfigDict, Field

from lockstep.api.pods import unclean_path_cel
from lockstep.api.shared import DType, cel, cel_literal, validations
from lockstep.schema import Model

MLFLOW_URI_PATTERN = r"^(https?://\S+|databricks(://\S+)?)$"
USER_INFO_PATTERN = "^[a-z]+://[^/]*@"
"""A URI with user info (https://user:secret@host/...), which would land in the job's ConfigMap for anyone who
reads it."""
USER_INFO_WHY = (
    " carries user info (user:password@): it would be written in the job and its ConfigMap, readable by anyone who "
    "reads them; write the URI without it, and take MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or "
    "MLFLOW_TRACKING_TOKEN) from a Secret in spec.trainer.env, with valueFrom.secretKeyRef"
)
"""Why a trackingUri with user info is refused, after the field's name."""


def has_user_info(uri: str) -> bool:
    """Whether ``uri`` carries user info (USER_INFO_PATTERN)."""
    return re.match(USER_INFO_PATTERN, uri) is not None


TRACKING_URI_RULE = cel(
    f"!has(self.trackingUri) || !self.trackingUri.matches({cel_literal(USER_INFO_PATTERN)})",
    "trackingUri carries user info (user:password@); take the credentials from a Secret in spec.trainer.env",
    field_path=".trackingUri",
    message_expression=f"'trackingUri' + {cel_literal(USER_INFO_WHY)}",
)
OUTPUT_PATH_WHY = (
    " is not written plainly (., .. or // in it): the trainer would write where the path resolves, not where it "
    "reads; write the directory plainly, e.g. /models/out"
)
"""Why spec.output.path is refused, after the path."""
OUTPUT_PATH_RULE = cel(
    f"!({unclean_path_cel('self')})",
    "spec.output.path is not written plainly (., .. or // in it); write the directory plainly",
    message_expression=f"self + {cel_literal(OUTPUT_PATH_WHY)}",
)
"""spec.output.path is written plainly (``environment.unclean_path``)."""


class MlflowTracking(Model):
    """One MLflow run for the job (docs/observability.md#experiment-tracking): every step's metrics, its
    evaluations, and its effective configuration as parameters."""

    model_config = ConfigDict(json_schema_extra=validations(TRACKING_URI_RULE))

    tracking_uri: Annotated[str, Field(pattern=MLFLOW_URI_PATTERN)] | None = Field(
        None,
        description="An MLflow tracking server: http://, https:// or databricks. Its credentials come from a "
        "Secret through spec.trainer.env (MLFLOW_TRACKING_TOKEN, or MLFLOW_TRACKING_USERNAME and "
        "MLFLOW_TRACKING_PASSWORD, with valueFrom.secretKeyRef; an inline value of a credential is refused). "
        "Default: unset, a store in the job's directory on spec.weightSync.volume, mlflow.db beside metrics.jsonl "
        "with the artifacts in mlflow-artifacts/ (no server: `mlflow ui --backend-store-uri sqlite:///<dir>/mlflow.db`).",
    )
    experiment: Annotated[str, Field(min_length=1, max_length=500)] | None = Field(
        None, description="The MLflow experiment, created when missing. Default: <namespace>/<job name>."
    )


class Tracking(Model):
    """Experiment tracking of the trainer's run (docs/observability.md), beside metrics.jsonl and Prometheus."""

    tensorboard: bool = Field(
        False,
        description="Write TensorBoard event files in tensorboard/ beside metrics.jsonl, in the job's directory on "
        "spec.weightSync.volume (no server needed: point `tensorboard --logdir` at it): every step's metrics under "
        "metrics.jsonl's names, each evaluation's eval_reward, and the effective configuration with its fingerprint "
        "at the step each trainer starts from. A restarted trainer goes on with the same run. Needs the tensorboard "
        "package in the trainer's image (lockstep[workers] has it). Default: false.",
    )
    mlflow: MlflowTracking | None = Field(
        None,
        description="Log the run to MLflow through its own client: every step's metrics under metrics.jsonl's "
        "names, at the step's number; the effective configuration as parameters, with its fingerprint as a tag and "
        "each trainer's start's configuration as an artifact. A restarted trainer resumes the same run. Needs "
        "mlflow-skinny in the trainer's image (lockstep[workers] has it). Default: unset, no MLflow.",
    )


class Output(Model):
    """Where the trainer writes the trained model, servable (docs/observability.md): a Hugging Face directory (the
    config, the tokenizer files with the chat template, the generation config and safetensors shards) or, in a LoRA
    job, PEFT's adapter directory. Trainer rank 0 writes it from a published version, into a temporary directory
    beside the final one and then renames it, so that nothing half-written is ever under the final name."""

    path: Annotated[
        str, Field(min_length=2, max_length=1024, pattern=r"^/", json_schema_extra=validations(OUTPUT_PATH_RULE))
    ] = Field(
        description="An absolute directory in the trainer pod, on a volume of spec.trainer.volumeMounts (e.g. a "
        "PersistentVolumeClaim): each write is its subdirectory v<version, 6 digits>, e.g. /models/out/v000100, "
        "which `vllm serve` takes as it is. status.output names the last one. Written plainly: a path with ., .. or // "
        "in it is refused (not normalised: what the job says is where the model lands)."
    )
    dtype: DType = Field(
        DType.BFLOAT16,
        description="The dtype of the written tensors (the trainer's master weights are fp32); auto: the base "
        "checkpoint's. Default: bfloat16.",
    )
    every_steps: Annotated[int, Field(ge=0)] = Field(
        0,
        description="Also write the model every this many steps, besides at the end of a successful job. 0 (the "
        "default): at the end only.",
    )
    merged: bool = Field(
        False,
        description="LoRA jobs (spec.trainer.lora): also write the base model with the adapter merged into it, in "
        "the subdirectory merged/ of each write, a whole Hugging Face model. Default: false, the adapter alone.",
    )
