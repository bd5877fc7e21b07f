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

from lockstep import api
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
