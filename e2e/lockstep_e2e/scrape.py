"""Prometheus text from the processes, and the metric names the Grafana dashboard in charts/ queries."""

from __future__ import annotations

import json
import re
import urllib.request

from lockstep_e2e.install import REPO

DASHBOARD = REPO / "charts" / "lockstep" / "dashboards" / "lockstep.json"


def scrape(url: str) -> str:
    """The text at ``url``/metrics."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as response:
        return str(response.read().decode())


def exported_metrics(text: str) -> set[str]:
    """The Lockstep metric families in a scrape (counters without ``_total``)."""
    return {name.removesuffix("_total") for name in re.findall(r"^# TYPE (lockstep_\w+) ", text, re.MULTILINE)}


def dashboard_metrics() -> set[str]:
    """The Lockstep metric families the dashboard's queries use."""
    expressions = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]
    used = {re.sub(r"_(bucket|sum|count)$", "", name) for e in expressions for name in re.findall(r"lockstep_\w+", e)}
    return {name.removesuffix("_total") for name in used}
