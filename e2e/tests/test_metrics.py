"""The operator exports the metrics the Grafana dashboard in charts/ uses, and they count what happened."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest
from kubernetes import client

from lockstep_e2e.fixtures import push_weights, running_job

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("lockstep")]

DASHBOARD = Path(__file__).resolve().parents[2] / "charts" / "lockstep" / "dashboards" / "lockstep.json"


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return str(response.read().decode())


def test_the_dashboard_uses_only_metrics_the_operator_exports(
    kube: client.ApiClient, namespace: str, operator_metrics_port: int
) -> None:
    push_weights(kube, namespace, "metered", running_job(kube, namespace, "metered", 2), 1)
    text = scrape(operator_metrics_port)

    exported = {name.removesuffix("_total") for name in re.findall(r"^# TYPE (lockstep_\w+) ", text, re.MULTILINE)}
    expressions = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]
    used = {re.sub(r"_(bucket|sum|count)$", "", name) for e in expressions for name in re.findall(r"lockstep_\w+", e)}
    used = {name.removesuffix("_total") for name in used}
    assert used, "the dashboard queries no Lockstep metric"
    assert used <= exported, f"the dashboard uses metrics nobody exports: {sorted(used - exported)}"

    assert re.search(rf'^lockstep_parity_locked{{namespace="{namespace}",rljob="metered"}} 1\.0$', text, re.MULTILINE)
    assert re.search(rf'^lockstep_weights_lag{{namespace="{namespace}",rljob="metered"}} 0\.0$', text, re.MULTILINE)
    completed = re.search(r'^lockstep_barriers_total{outcome="Completed"} (\d+)\.0$', text, re.MULTILINE)
    assert completed and int(completed.group(1)) >= 1
    assert re.search(r'^lockstep_barrier_phase_duration_seconds_count{phase="Update"} [1-9]', text, re.MULTILINE)
