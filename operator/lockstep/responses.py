"""The API server's answers, read as JSON rather than built into the kubernetes client's model classes (which
costs more than the call itself on a busy operator)."""

from __future__ import annotations

import json
from typing import Any


def body(response: Any) -> dict[str, Any]:
    """The JSON body of a call made with ``_preload_content=False``."""
    answer: dict[str, Any] = json.loads(response.data)
    return answer
