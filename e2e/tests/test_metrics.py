"""The operator's metrics count what happened. (The dashboard's names are checked against the operator's,
the actors' and the trainer's exports in test_rl_job.)"""

from __future__ import annotations

import re

import pytest
from kubernetes import client

from lockstep_e2e.fixtures import push_weights, running_job
from lockstep_e2e.scrape import scrape

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("lockstep")]


def test_the_operator_counts_jobs_parity_and_barriers(
    kube: client.ApiClient, namespace: str, operator_metrics_port: int
) -> None:
    push_weights(kube, namespace, "metered", running_job(kube, namespace, "metered", 2), 1)
    text = scrape(f"http://127.0.0.1:{operator_metrics_port}")

    assert re.search(rf'^lockstep_parity_locked{{namespace="{namespace}",rljob="metered"}} 1\.0$', text, re.MULTILINE)
    assert re.search(rf'^lockstep_weights_lag{{namespace="{namespace}",rljob="metered"}} 0\.0$', text, re.MULTILINE)
    completed = re.search(r'^lockstep_barriers_total{outcome="Completed"} (\d+)\.0$', text, re.MULTILINE)
    assert completed and int(completed.group(1)) >= 1
    assert re.search(r'^lockstep_barrier_phase_duration_seconds_count{phase="Update"} [1-9]', text, re.MULTILINE)
