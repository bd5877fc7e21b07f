"""What a role's pods take from the job as it is written (PodOverrides): resources, scheduling, env, volumes and
mounts, with the CEL rules that keep the operator's own variables, volumes and mounts out of the job's reach."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, ConfigDict, Field, WithJsonSchema

from lockstep import environment
from lockstep.api.shared import cel, cel_literal, cel_starts_with_any, cel_strings, validations
from lockstep.schema import OPAQUE_LIST, OPAQUE_OBJECT, Model

QUANTITY_PATTERN = r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$"
"""A Kubernetes resource quantity (the API server's own pattern): 500m, 2, 16Gi, 1e3."""
Quantity = Annotated[
    str,
    BeforeValidator(lambda value: str(value) if type(value) is int else value),
    Field(pattern=QUANTITY_PATTERN),
    WithJsonSchema({"anyOf": [{"type": "integer"}, {"type": "string", "pattern": QUANTITY_PATTERN}]}),
]
ENV_NAME_PATTERN = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"


RESERVED_ENV_RULE = cel(
    f"!self.startsWith('{environment.RESERVED_PREFIX}') && !(self in {cel_strings(environment.RESERVED_NAMES)})",
    "the Lockstep operator sets this variable itself; remove it from env",
    message_expression=f"self + '{environment.RESERVED_ENV_WHY}'",
)
"""The job's env may not take over a variable the operator sets (``environment.reserved_env``)."""
_UNLISTED = f"!(self in {cel_strings(environment.ALLOWED_ENV)})"
_NUMERICS = f"({_UNLISTED} && {cel_starts_with_any('self', environment.NUMERICS_ENV_PREFIXES)})"
_CODE_LOADING = (
    f"({_UNLISTED} && ({cel_starts_with_any('self', environment.CODE_LOADING_ENV_PREFIXES)} || "
    f"self in {cel_strings(environment.CODE_LOADING_ENV_NAMES)}))"
)
LOCKED_ENV_RULE = cel(
    f"!{_NUMERICS} && !{_CODE_LOADING}",
    "this variable would change the numbers the workers compute or the code they load, behind the lock of the "
    "ParityPolicy; remove it from env",
    message_expression=f"self + ({_NUMERICS} ? {cel_literal(environment.NUMERICS_WHY)} : "
    f"{cel_literal(environment.CODE_LOADING_WHY)})",
)
"""The job's env may not change the workers' numerics or the code they load (``environment.locked_env_why``)."""
_CREDENTIAL = (
    f"(self.name in {cel_strings(environment.CREDENTIAL_NAMES)} || "
    f"{' || '.join(f'self.name.endsWith({cel_literal(s)})' for s in environment.CREDENTIAL_SUFFIXES)} || "
    f"{' || '.join(f'self.name.contains({cel_literal(s)})' for s in environment.CREDENTIAL_INFIXES)})"
)
CREDENTIAL_ENV_RULE = cel(
    f"!{_CREDENTIAL} || (!has(self.value) && has(self.valueFrom) && has(self.valueFrom.secretKeyRef))",
    "this variable names a credential: take it from a Secret (valueFrom.secretKeyRef), never inline or from a "
    "ConfigMap",
    message_expression=f"self.name + {cel_literal(environment.CREDENTIAL_WHY)}",
)
"""A credential comes from a Secret (``environment.credential``, ``environment.from_secret``)."""


def unclean_path_cel(absolute: str) -> str:
    """CEL: ``environment.unclean_path(absolute)``."""
    unclean = [f"{absolute}.contains('{part}')" for part in environment.UNCLEAN_PATH_PARTS]
    unclean += [f"{absolute}.endsWith('{ending}')" for ending in environment.UNCLEAN_PATH_ENDINGS]
    return " || ".join(unclean)


def _reserved_mount_cel() -> str:
    """CEL: ``environment.reserved_mount(self)``."""
    absolute = "(self.startsWith('/') ? self : '/' + self)"
    unclean = [unclean_path_cel(absolute)]
    under = [f"{absolute} == '{root}' || {absolute}.startsWith('{root}/')" for root in environment.RESERVED_MOUNTS]
    return " || ".join(unclean + under)


RESERVED_MOUNT_RULE = cel(
    f"!({_reserved_mount_cel()})",
    "the Lockstep operator mounts this path itself, or it is not written plainly; mount elsewhere",
    message_expression=f"'mountPath ' + self + '{environment.RESERVED_MOUNT_WHY}'",
)
"""The job's volumeMounts may not cover the operator's own mounts (``environment.reserved_mount``)."""
RESERVED_VOLUME_RULE = cel(
    f"!self.startsWith('{environment.RESERVED_VOLUME_PREFIX}')",
    f"volume names starting with {environment.RESERVED_VOLUME_PREFIX} are the Lockstep operator's; rename the volume",
    message_expression=f"'volume ' + self + '{environment.RESERVED_VOLUME_WHY}'",
)
"""The job's volumes may not take an operator volume's name (``environment.reserved_volume``)."""
RESERVED_VOLUME_MOUNT_RULE = cel(
    f"!self.startsWith('{environment.RESERVED_VOLUME_PREFIX}')",
    f"volumes named {environment.RESERVED_VOLUME_PREFIX}* are the Lockstep operator's (lockstep-shared holds every "
    "job's weights); mount a volume of the job's own",
    message_expression=f"'volume ' + self + '{environment.RESERVED_VOLUME_MOUNT_WHY}'",
)
"""The job's volumeMounts may not mount an operator volume (``environment.reserved_volume``): the shared volume
whole, or another job's directory of it by subPath."""
MAX_PASSED_THROUGH = 128
"""The most volumes, volumeMounts or env entries a role may add: the API server needs bounds on the lists and
strings these rules read, to cost them."""
MAX_NAME_LENGTH = 256
"""The longest environment variable name a role may add."""


def _passed_through(*keys: tuple[str, str, dict[str, str], int]) -> dict[str, Any]:
    """A list of core objects passed through to pods as they are, with each of ``keys`` (its name, its description,
    the rule that checks it, its longest length) declared as a string so that its rule checks it."""
    declared = {
        key: {"type": "string", "maxLength": max_length, "description": description, **validations(rule)}
        for key, description, rule, max_length in keys
    }
    item = {**OPAQUE_OBJECT, "properties": declared}
    return {"type": "array", "maxItems": MAX_PASSED_THROUGH, "items": item}


class Resources(Model):
    """Compute resources of the role's container, as in a pod (quantities checked when the RLJob is applied)."""

    limits: dict[str, Quantity] | None = Field(None, description="e.g. {cpu: 4, memory: 16Gi, nvidia.com/gpu: 1}")
    requests: dict[str, Quantity] | None = Field(
        None, description="What the scheduler reserves, by resource name: quantities as in limits. Default: the limits."
    )
    claims: list[dict[str, Any]] | None = Field(
        None, description="Dynamic resource claims the container uses, as in a pod.", json_schema_extra=OPAQUE_LIST
    )


VALUE_SOURCES = ("fieldRef", "resourceFieldRef", "configMapKeyRef", "secretKeyRef")
"""The sources of an env entry's value, as in a pod: declared, so that CEL may ask which one an entry uses."""


class EnvVar(Model):
    """An environment variable of the role's container, as in a pod: a value, or valueFrom a source."""

    model_config = ConfigDict(json_schema_extra=validations(CREDENTIAL_ENV_RULE))

    name: Annotated[str, Field(pattern=ENV_NAME_PATTERN, max_length=MAX_NAME_LENGTH)] = Field(
        description="The variable's name; not one the operator sets (LOCKSTEP_*, POD_NAME, POD_NAMESPACE, and the "
        "torch.distributed rendezvous: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK), nor one that changes "
        "the numbers the workers compute or the code they load (ONEDNN_*, MKL_*, OMP_*, TORCH*, NVIDIA_*, "
        "VLLM_*..., LD_*, PATH, PYTHON*...). Only the documented variables (docs/security.md#environment), NCCL_*, "
        "those under spec.envPrefix and those the ParityPolicy adds in its spec.env may be set; a credential "
        "(MLFLOW_TRACKING_TOKEN, AWS_SECRET_ACCESS_KEY, *_TOKEN, *_PASSWORD, *_API_KEY, *_SECRET*...) only from a "
        "Secret (valueFrom.secretKeyRef).",
        json_schema_extra=validations(RESERVED_ENV_RULE, LOCKED_ENV_RULE),
    )
    value: str | None = Field(None, description="The value; unset with valueFrom.")
    value_from: dict[str, Any] | None = Field(
        None,
        description="A source of the value, as in a pod: fieldRef, resourceFieldRef, configMapKeyRef, secretKeyRef "
        "(a credential's only source).",
        json_schema_extra={
            **OPAQUE_OBJECT,
            "properties": {
                source: {**OPAQUE_OBJECT, "description": f"As a pod's env[].valueFrom.{source}."}
                for source in VALUE_SOURCES
            },
        },
    )


class PodOverrides(Model):
    """Kubernetes pod fields passed through to the pods of one role."""

    resources: Resources | None = None
    node_selector: dict[str, str] | None = Field(
        None, description="Node labels the role's pods must run on, as in a pod. Default: any node."
    )
    tolerations: list[dict[str, Any]] | None = Field(
        None, description="Taints the role's pods tolerate, as in a pod.", json_schema_extra=OPAQUE_LIST
    )
    affinity: dict[str, Any] | None = Field(
        None, description="Node and pod affinity of the role's pods, as in a pod.", json_schema_extra=OPAQUE_OBJECT
    )
    env: list[EnvVar] | None = Field(
        None,
        max_length=MAX_PASSED_THROUGH,
        description="Environment variables added to the role's container, after the ones the operator sets. HOME "
        "(default /home/lockstep, the operator's writable emptyDir) may be set here instead.",
    )
    volumes: list[dict[str, Any]] | None = Field(
        None,
        max_length=MAX_PASSED_THROUGH,
        description="Volumes added to the role's pods, as in a pod (e.g. the model's, at spec.model.uri); names "
        "starting with lockstep- are the operator's.",
        json_schema_extra=_passed_through(("name", "The volume's name, as in a pod.", RESERVED_VOLUME_RULE, 63)),
    )
    volume_mounts: list[dict[str, Any]] | None = Field(
        None,
        max_length=MAX_PASSED_THROUGH,
        description="Mounts of those volumes in the role's container, as in a pod. The operator mounts "
        "/etc/lockstep (the effective configuration) and /var/lib/lockstep (spec.weightSync.volume) itself: nothing "
        "may be mounted at or under them. It also mounts emptyDirs on the read-only root filesystem at /tmp, "
        "/home/lockstep and (GPU pods) /dev/shm, which a mount here at the same path replaces. A volume named "
        "lockstep-* is the operator's and may not be mounted here.",
        json_schema_extra=_passed_through(
            (
                "name",
                "The mounted volume's name; not one of the operator's (lockstep-*).",
                RESERVED_VOLUME_MOUNT_RULE,
                63,
            ),
            ("mountPath", "Where the volume appears in the container, as in a pod.", RESERVED_MOUNT_RULE, 1024),
        ),
    )


def _reaches_locked_env_cel(*, prefix: bool) -> str:
    """CEL: ``environment.reaches_locked_env(self, prefix=prefix)``."""
    names = (*environment.CODE_LOADING_ENV_NAMES, *environment.RESERVED_NAMES)
    reaches = f"{cel_starts_with_any('self', environment.DENIED_ENV_PREFIXES)} || self in {cel_strings(names)}"
    if prefix:
        reaches += f" || {cel_strings((*environment.DENIED_ENV_PREFIXES, *names))}.exists(l, l.startsWith(self))"
    return reaches


ENV_PREFIX_RULE = cel(
    f"!({_reaches_locked_env_cel(prefix=True)})",
    "this prefix reaches variables that change the numbers the workers compute, the code they load, or the "
    "operator's own; choose a prefix of the job's own, e.g. APP_",
    message_expression=f"self + {cel_literal(environment.PREFIX_WHY)}",
)
"""spec.envPrefix, and a ParityPolicy's spec.env.prefixes, reach no locked variable
(``environment.reaches_locked_env``)."""
ENV_NAME_RULE = cel(
    f"!({_reaches_locked_env_cel(prefix=False)})",
    "this variable changes the numbers the workers compute, the code they load, or is the operator's own: no policy "
    "may allow it",
    message_expression=f"self + {cel_literal(environment.PREFIX_WHY)}",
)
"""A ParityPolicy's spec.env.names are no locked variable (``environment.reaches_locked_env``)."""
ENV_PREFIX_PATTERN = r"^[A-Za-z][A-Za-z0-9]*_$"
EnvPrefix = Annotated[
    str, Field(pattern=ENV_PREFIX_PATTERN, max_length=64, json_schema_extra=validations(ENV_PREFIX_RULE))
]
"""A prefix of variables, e.g. APP_: letters and digits, then one underscore."""
EnvName = Annotated[
    str, Field(pattern=ENV_NAME_PATTERN, max_length=MAX_NAME_LENGTH, json_schema_extra=validations(ENV_NAME_RULE))
]


class EnvAllowance(Model):
    """Variables a ParityPolicy lets the jobs it governs set, besides the documented ones
    (docs/security.md#environment). None may change the numbers the workers compute, the code they load, or be the
    operator's own."""

    names: list[EnvName] = Field(
        default_factory=list, max_length=MAX_PASSED_THROUGH, description="Whole names, e.g. WANDB_PROJECT."
    )
    prefixes: list[EnvPrefix] = Field(
        default_factory=list, max_length=MAX_PASSED_THROUGH, description="Prefixes, e.g. WANDB_: every name under it."
    )
