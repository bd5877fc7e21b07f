"""The Helm chart: it lints, renders into objects the API server accepts, installs, and the operator it
installs reconciles an RLJob with only the chart's least-privilege RBAC."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client

from lockstep import keys
from lockstep_e2e import build
from lockstep_e2e.cluster import LocalCluster, free_port
from lockstep_e2e.fixtures import wait_for
from lockstep_e2e.install import REPO
from lockstep_e2e.jobs import create_job, get_job, phase, rljob
from lockstep_e2e.podrunner import run_pod

pytestmark = pytest.mark.cluster

CHART = REPO / "charts" / "lockstep"
RELEASE, NAMESPACE = "lockstep", keys.OPERATOR_NAMESPACE


@pytest.fixture(scope="module")
def bare(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A cluster of its own, with nothing of Lockstep in it: the chart installs everything."""
    with LocalCluster(tmp_path_factory.mktemp("chart-cluster")) as local:
        yield local


def helm(cluster: LocalCluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(build.build_helm()), f"--kubeconfig={cluster.kubeconfig}", *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )


def kubectl(cluster: LocalCluster, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(build.bin_dir() / "kubectl"), f"--kubeconfig={cluster.kubeconfig}", *args],
        input=stdin,
        capture_output=True,
        text=True,
        check=False,
    )


def test_helm_lint_passes(bare: LocalCluster) -> None:
    linted = helm(bare, "lint", str(CHART), "--strict")
    assert linted.returncode == 0, linted.stdout + linted.stderr


def test_rendered_chart_is_accepted_by_the_api_server(bare: LocalCluster) -> None:
    rendered = helm(bare, "template", RELEASE, str(CHART), "-n", NAMESPACE, "--include-crds")
    assert rendered.returncode == 0, rendered.stderr
    crds = [d for d in rendered.stdout.split("\n---") if "kind: CustomResourceDefinition" in d]
    assert len(crds) == 2
    # The CRDs must exist before a dry run can check a ParityPolicy; everything else is only dry-run.
    applied = kubectl(bare, "apply", "--server-side", "-f", "-", stdin="\n---".join(crds))
    assert applied.returncode == 0, applied.stderr
    kubectl(bare, "wait", "--for=condition=Established", "crd/rljobs.lockstep.dev", "crd/paritypolicies.lockstep.dev")
    kubectl(bare, "create", "namespace", NAMESPACE)
    dry = kubectl(bare, "apply", "--server-side", "--dry-run=server", "-f", "-", stdin=rendered.stdout)
    assert dry.returncode == 0, dry.stderr
    for kind in ("deployment.apps", "clusterrole.rbac.authorization.k8s.io", "validatingadmissionpolicy"):
        assert kind in dry.stdout


def test_installed_operator_reconciles_a_job_with_least_privilege(bare: LocalCluster, tmp_path: Path) -> None:
    liveness, metrics = free_port(), free_port()
    installed = helm(
        bare,
        "install",
        RELEASE,
        str(CHART),
        "-n",
        NAMESPACE,
        "--create-namespace",
        "--wait",
        "--timeout=120s",
        f"--set=operator.livenessPort={liveness}",
        f"--set=operator.metricsPort={metrics}",
    )
    assert installed.returncode == 0, installed.stdout + installed.stderr
    api = bare.api_client()
    core = client.CoreV1Api(api)
    operator_pod = core.list_namespaced_pod(NAMESPACE, label_selector="app.kubernetes.io/name=lockstep").items[0]
    # kwok keeps the pod's status; its container command runs here, as the chart's service account.
    operator = run_pod(bare, api, NAMESPACE, operator_pod.metadata.name, tmp_path / "operator.log")
    try:
        core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name="team")))
        wait_for(lambda: core.list_namespaced_service_account("team").items, "the team's default service account")
        create_job(api, "team", rljob("charted", actors=2))
        wait_for(lambda: phase(get_job(api, "team", "charted")) == "Running", "the installed operator to run the job")
        job = get_job(api, "team", "charted")
        assert next(c for c in job["status"]["conditions"] if c["type"] == "ParityLocked")["status"] == "True"
        assert job["status"]["parityPolicy"] == "default", "the chart installed the default ParityPolicy"
        operator.check_alive()
        assert "Forbidden" not in operator.log_path.read_text(), operator.log_tail()
    finally:
        operator.stop()
