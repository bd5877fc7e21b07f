"""RFC 3339 timestamps, as the Kubernetes API writes them (UTC, with a Z)."""

from __future__ import annotations

import datetime as dt


def rfc3339(moment: dt.datetime, *, milliseconds: bool = False) -> str:
    """Seconds precision, like metav1.Time; milliseconds where durations are measured from it."""
    return (
        moment.astimezone(dt.UTC)
        .isoformat(timespec="milliseconds" if milliseconds else "seconds")
        .replace("+00:00", "Z")
    )


def parse_rfc3339(text: str) -> dt.datetime:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
