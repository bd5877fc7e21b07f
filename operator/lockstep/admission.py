"""Admission-time parity enforcement: a native ValidatingAdmissionPolicy with ParityPolicy as its parameter.

The API server evaluates the policy once per ParityPolicy (the binding selects them all) on every RLJob CREATE,
and on every UPDATE that changes ``spec``. A ParityPolicy *applies* to a job when all of these hold:

- its ``spec.enforcement`` is ``Enforce`` (Warn and Audit are the operator's business, not admission's);
- the job names it in ``spec.parityPolicy``, or names none and the policy has ``spec.default: true``;
- the job's namespace carries every label in its ``spec.namespaceSelector.matchLabels`` (empty: every namespace).

Then every key the policy locks in ``spec.vllm`` that the job also sets in ``spec.actors.vllm`` must be equal
(maps compare as a whole, like ``lockstep.parity.effective_config``), or the request is refused with reason
``Invalid`` and a message naming the key and the locked value. One validation per field of
``api.VllmSettings``, generated from the model, so a new field is enforced without editing this file.

The expressions rely on the CRDs' structural defaults (``spec.actors.vllm``, ``spec.vllm``, ``spec.default``
and ``spec.enforcement`` are always present once the API server has decoded an object).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lockstep import api, keys
from lockstep.crds import structural_schema

NAME = "lockstep-parity-enforce"
"""Name of both the ValidatingAdmissionPolicy and its binding."""

ADMISSION_API_VERSION = "admissionregistration.k8s.io/v1"

_VARIABLES = [
    ("named", "has(object.spec.parityPolicy) ? object.spec.parityPolicy : ''"),
    ("selected", "variables.named == params.metadata.name || (variables.named == '' && params.spec.default)"),
    (
        "inNamespace",
        "!has(params.spec.namespaceSelector.matchLabels) || params.spec.namespaceSelector.matchLabels.all(k, "
        "has(namespaceObject.metadata.labels) && k in namespaceObject.metadata.labels && "
        "namespaceObject.metadata.labels[k] == params.spec.namespaceSelector.matchLabels[k])",
    ),
    (
        "enforced",
        f"params.spec.enforcement == '{api.Enforcement.ENFORCE.value}' && variables.selected && variables.inNamespace",
    ),
]


@dataclass(frozen=True)
class Key:
    """One field of ``api.VllmSettings`` as CEL sees it."""

    name: str
    """The camelCase name on the wire."""
    is_map: bool
    typed: bool
    """Whether the API server's CEL type checker knows the field (see ``_cel_typed``)."""


def vllm_keys() -> list[Key]:
    """Every field of ``api.VllmSettings``, in declaration order, with what its CRD schema says about it."""
    schema = structural_schema(api.VllmSettings)["properties"]
    keys = [field.alias or name for name, field in api.VllmSettings.model_fields.items()]
    return [Key(key, schema[key].get("type") == "object", _cel_typed(schema[key])) for key in keys]


def _cel_typed(schema: dict[str, Any]) -> bool:
    """Whether Kubernetes declares a CEL type for a field with this structural schema.

    It leaves out a field whose schema, or whose items' or values' schema, has no ``type`` (such as
    ``hfOverrides``, a map of ``x-kubernetes-preserve-unknown-fields`` scalars): selecting it is then a
    type-check error ("undefined field"), though the value is there at run time.
    """
    inner = schema.get("items") or schema.get("additionalProperties")
    return "type" in schema and (not isinstance(inner, dict) or _cel_typed(inner))


def _cel_string(value: str, *, is_map: bool) -> str:
    """CEL that renders ``value`` for a message: ``processed_logprobs``, ``false``, ``{head_dtype: float32}``."""
    if is_map:
        return f"'{{' + {value}.map(k, k + ': ' + string({value}[k])).join(', ') + '}}'"
    return f"string({value})"


def validation(key: Key) -> dict[str, str]:
    """The check for one ``spec.actors.vllm`` key: refused when the applying policy locks it to another value."""
    # A field the type checker does not know is selected from a dyn() value: checked at run time only.
    locked, requested = (
        (f"params.spec.vllm.{key.name}", f"object.spec.actors.vllm.{key.name}")
        if key.typed
        else (f"dyn(params.spec.vllm).{key.name}", f"dyn(object.spec.actors.vllm).{key.name}")
    )
    path = f"spec.actors.vllm.{key.name}"
    return {
        "expression": f"!variables.enforced || !has({locked}) || !has({requested}) || {requested} == {locked}",
        "messageExpression": (
            f'"{path}: ParityPolicy \'" + params.metadata.name + "\' (" + params.spec.enforcement + ") locks it to "'
            f' + {_cel_string(locked, is_map=key.is_map)} + "; remove the key or set it to that value"'
        ),
        "message": f"{path}: an Enforce ParityPolicy locks it to another value; remove the key or set it to that value",
        "reason": "Invalid",
    }


def policy() -> dict[str, Any]:
    """The ValidatingAdmissionPolicy (cluster-scoped), with ParityPolicy as its paramKind."""
    return {
        "apiVersion": ADMISSION_API_VERSION,
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": NAME},
        "spec": {
            "failurePolicy": "Fail",
            "paramKind": {"apiVersion": api.API_VERSION, "kind": "ParityPolicy"},
            "matchConstraints": {
                "resourceRules": [
                    {
                        "apiGroups": [api.GROUP],
                        "apiVersions": [api.VERSION],
                        "operations": ["CREATE", "UPDATE"],
                        "resources": ["rljobs"],
                    }
                ]
            },
            # An update that leaves the spec alone (finalizers, labels, deletion) is never refused, so a job
            # created before a conflicting policy can still be cleaned up.
            "matchConditions": [
                {"name": "spec-written", "expression": "request.operation == 'CREATE' || object.spec != oldObject.spec"}
            ],
            "variables": [{"name": name, "expression": expression} for name, expression in _VARIABLES],
            "validations": [validation(key) for key in vllm_keys()],
        },
    }


def binding() -> dict[str, Any]:
    """The binding: every ParityPolicy is a parameter; none at all means nothing to enforce."""
    return {
        "apiVersion": ADMISSION_API_VERSION,
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": NAME},
        "spec": {
            "policyName": NAME,
            "paramRef": {"selector": {}, "parameterNotFoundAction": "Allow"},
            "validationActions": ["Deny"],
        },
    }


def manifests() -> list[dict[str, Any]]:
    """The policy and its binding, in the order to apply them."""
    return [policy(), binding()]


# -- who may write the barrier annotations (docs/barrier-protocol.md) ---------------------

BARRIER_POLICY = "lockstep-barrier-annotations"
OPERATOR_KEYS = {"barrier": keys.BARRIER, "initialWeights": keys.INITIAL_WEIGHTS}
"""Annotations only the operator writes, by the CEL variable that says whether a request changes them."""
POD_KEYS = {
    "barrierAck": keys.BARRIER_ACK,
    "weights": keys.WEIGHTS,
    "mismatch": keys.MISMATCH,
    "preflight": keys.PREFLIGHT,
}
"""Annotations a pod writes on itself only."""


def _annotation(side: str, key: str) -> str:
    """CEL: the annotation's value on ``object`` or ``oldObject``, '' when absent (oldObject is null on CREATE)."""
    annotations = f"{side}.metadata.annotations"
    value = f"(has({annotations}) && '{key}' in {annotations} ? {annotations}['{key}'] : '')"
    return f"({side} == null ? '' : {value})" if side == "oldObject" else value


def barrier_policy(operator_username: str = keys.OPERATOR_USERNAME) -> dict[str, Any]:
    """Only ``operator_username`` may write barrier commands; a pod may write its ack only on itself."""
    changed = [
        {"name": f"{name}Changed", "expression": f"{_annotation('oldObject', key)} != {_annotation('object', key)}"}
        for name, key in {**OPERATOR_KEYS, **POD_KEYS}.items()
    ]
    caller = [
        {"name": "isOperator", "expression": f"request.userInfo.username == '{operator_username}'"},
        {
            "name": "podName",
            "expression": f"'{keys.POD_NAME_EXTRA}' in request.userInfo.extra ? "
            f"request.userInfo.extra['{keys.POD_NAME_EXTRA}'][0] : ''",
        },
    ]
    operator_only = [
        {
            "expression": f"!variables.{name}Changed || variables.isOperator",
            "messageExpression": f"'{key} may be written only by the Lockstep operator ({operator_username}), "
            "not by ' + request.userInfo.username",
            "reason": "Forbidden",
        }
        for name, key in OPERATOR_KEYS.items()
    ]
    own_pod_only = [
        {
            "expression": f"!variables.{name}Changed || variables.podName == object.metadata.name",
            "messageExpression": f"'{key} on pod ' + object.metadata.name + ' may be written only by that pod itself "
            "(a service-account token bound to it), not by ' + request.userInfo.username + "
            "(variables.podName == '' ? '' : ' for pod ' + variables.podName)",
            "reason": "Forbidden",
        }
        for name, key in POD_KEYS.items()
    ]
    return {
        "apiVersion": ADMISSION_API_VERSION,
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": BARRIER_POLICY},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {
                "resourceRules": [
                    {
                        "apiGroups": [""],
                        "apiVersions": ["v1"],
                        "operations": ["CREATE", "UPDATE"],
                        "resources": ["pods"],
                    }
                ]
            },
            "variables": changed + caller,
            "validations": operator_only + own_pod_only,
        },
    }


def barrier_manifests(operator_username: str = keys.OPERATOR_USERNAME) -> list[dict[str, Any]]:
    """The barrier policy and its binding."""
    binding = {
        "apiVersion": ADMISSION_API_VERSION,
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": BARRIER_POLICY},
        "spec": {"policyName": BARRIER_POLICY, "validationActions": ["Deny"]},
    }
    return [barrier_policy(operator_username), binding]
