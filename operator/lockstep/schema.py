"""The base of every lockstep.dev model, API objects and wire documents alike."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel

OPAQUE_OBJECT: dict[str, Any] = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
OPAQUE_LIST: dict[str, Any] = {"type": "array", "items": OPAQUE_OBJECT}
"""Kubernetes core types passed through to pods as they are (validated by the API server on the pod)."""


class Model(BaseModel):
    """camelCase on the wire, snake_case in Python; unknown fields are errors."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")
