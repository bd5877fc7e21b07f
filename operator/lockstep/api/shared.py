"""What every kind of the lockstep.dev API shares: its group and version, the helpers that write the CEL rules the
API server enforces, and DType."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

GROUP = "lockstep.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
RLJOBS = "rljobs"
PARITY_POLICIES = "paritypolicies"


def cel(
    rule: str,
    message: str,
    *,
    field_path: str | None = None,
    reason: str | None = None,
    message_expression: str | None = None,
) -> dict[str, str]:
    """One x-kubernetes-validations entry (``message_expression``: CEL that words the message from ``self``;
    ``message`` is the API server's fallback when that fails)."""
    entry = {"rule": rule, "message": message}
    if message_expression:
        entry["messageExpression"] = message_expression
    if field_path:
        entry["fieldPath"] = field_path
    if reason:
        entry["reason"] = reason
    return entry


def cel_literal(text: str) -> str:
    """``text`` as a double-quoted CEL string (the messages here hold neither double quotes nor backslashes)."""
    assert '"' not in text and "\\" not in text, text
    return f'"{text}"'


def cel_strings(items: tuple[str, ...]) -> str:
    """``items`` as a CEL list of strings."""
    return "[" + ", ".join(cel_literal(item) for item in items) + "]"


def cel_starts_with_any(subject: str, prefixes: tuple[str, ...]) -> str:
    """CEL: whether ``subject`` starts with one of ``prefixes``."""
    return "(" + " || ".join(f"{subject}.startsWith({cel_literal(prefix)})" for prefix in prefixes) + ")"


def validations(*rules: dict[str, str]) -> dict[str, Any]:
    return {"x-kubernetes-validations": list(rules)}


def immutable(field: str, why: str) -> dict[str, Any]:
    return validations(cel("self == oldSelf", f"{field} is immutable while the RLJob exists: {why}"))


class DType(StrEnum):
    AUTO = "auto"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    FLOAT32 = "float32"
