"""The base of every lockstep.dev model, API objects and wire documents alike, and the structural schema a model
gives a CRD or an admission policy (``structural_schema``)."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel

OPAQUE_OBJECT: dict[str, Any] = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
OPAQUE_LIST: dict[str, Any] = {"type": "array", "items": OPAQUE_OBJECT}
"""Kubernetes core types passed through to pods as they are (validated by the API server on the pod)."""


class Model(BaseModel):
    """camelCase on the wire, snake_case in Python; unknown fields are errors."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


# JSON-schema keywords that an OpenAPI v3 structural schema keeps as they are.
_KEPT = (
    "type",
    "description",
    "enum",
    "minimum",
    "maximum",
    "minLength",
    "maxLength",
    "pattern",
    "format",
    "minItems",
    "maxItems",
    "x-kubernetes-validations",
    "x-kubernetes-preserve-unknown-fields",
)


def structural_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The model's JSON schema, inlined and reduced to what a structural CRD schema allows."""
    schema = model.model_json_schema(by_alias=True, mode="validation")
    return _convert(schema, schema.get("$defs", {}))


def _convert(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        return _convert({**target, **{k: v for k, v in node.items() if k != "$ref"}}, defs)
    if "anyOf" in node:
        options = [option for option in node["anyOf"] if option.get("type") != "null"]
        rest = {k: v for k, v in node.items() if k != "anyOf"}
        if len(options) == 1:
            return _convert({**options[0], **rest}, defs)
        if sorted(option.get("type") for option in options) == ["integer", "string"]:
            # A quantity or a port: Kubernetes' int-or-string, whose string form keeps its pattern.
            text = next(option for option in options if option["type"] == "string")
            converted = {key: value for key, value in _convert({**text, **rest}, defs).items() if key != "type"}
            return {**converted, "x-kubernetes-int-or-string": True}
        # A union of scalars (e.g. str | int | bool) has no structural type: keep it as it is.
        return {**_convert(rest, defs), "x-kubernetes-preserve-unknown-fields": True}
    out: dict[str, Any] = {key: node[key] for key in _KEPT if key in node}
    if "exclusiveMinimum" in node:
        out.update(minimum=node["exclusiveMinimum"], exclusiveMinimum=True)
    if "exclusiveMaximum" in node:
        out.update(maximum=node["exclusiveMaximum"], exclusiveMaximum=True)
    if node.get("default") is not None:
        out["default"] = node["default"]
        if node["default"] not in ("", [], {}) and "description" in out:
            # kubectl explain shows descriptions only: each one says its default, taken from the model.
            text = out["description"].rstrip()
            out["description"] = f"{text if text.endswith('.') else text + '.'} Default: {_shown(node['default'])}."
    if "properties" in node:
        out["properties"] = {
            name: _property(prop, defs, required=name in node.get("required", []))
            for name, prop in node["properties"].items()
        }
        if node.get("required"):
            out["required"] = list(node["required"])
    if "items" in node:
        out["items"] = _convert(node["items"], defs)
    extra = node.get("additionalProperties")
    if isinstance(extra, dict) and extra:
        out["additionalProperties"] = _convert(extra, defs)
    elif extra is True or extra == {}:
        out["x-kubernetes-preserve-unknown-fields"] = True
    return out


def _shown(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _property(prop: dict[str, Any], defs: dict[str, Any], *, required: bool) -> dict[str, Any]:
    converted = _convert(prop, defs)
    # An optional nested object defaults to {} so that its own field defaults apply (and CEL can read them).
    if not required and "default" not in converted and "properties" in converted and _is_model_ref(prop):
        converted["default"] = {}
    return converted


def _is_model_ref(prop: dict[str, Any]) -> bool:
    return "$ref" in prop
