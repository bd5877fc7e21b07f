"""Pod Security: every pod Lockstep creates is admitted where a namespace enforces the "restricted" level (the
local API server runs the PodSecurity admission plugin, as every cluster does by default)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kubernetes import client

from lockstep import keys
from lockstep.protocol import PreflightResult, document
from lockstep_e2e.fixtures import fresh_namespace, wait_for
from lockstep_e2e.install import pod_client
from lockstep_e2e.jobs import condition, create_job, get_job, job_pods, phase, rljob

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("lockstep")]


@pytest.fixture
def restricted(kube: client.ApiClient, request: pytest.FixtureRequest) -> Iterator[str]:
    """A namespace whose pods must meet Pod Security "restricted" (the API server refuses any other)."""
    with fresh_namespace(kube, request.node.name) as name:
        labels = {
            "pod-security.kubernetes.io/enforce": "restricted",
            "pod-security.kubernetes.io/enforce-version": "latest",
        }
        client.CoreV1Api(kube).patch_namespace(name, {"metadata": {"labels": labels}})
        yield name


def test_the_preflight_actor_and_trainer_pods_meet_pod_security_restricted(
    kube: client.ApiClient, restricted: str
) -> None:
    """Without their security context the API server refused each pod there, and the job stalled ChildRejected."""
    # A collective backend: the trainer's volume is an emptyDir (restricted allows no hostPath).
    create_job(
        kube, restricted, rljob("guarded", actors=2, weightSync={"backend": "gloo"}, preflight={"enabled": True})
    )
    checker = "guarded-preflight-0"

    def preflight_pod_exists() -> bool:
        ready = condition(get_job(kube, restricted, "guarded"), "Ready")
        assert ready.get("reason") != "ChildRejected", ready["message"]
        return any(pod.metadata.name == checker for pod in job_pods(kube, restricted, "guarded"))

    wait_for(preflight_pod_exists, "the preflight pod")
    result = PreflightResult(
        mean_abs_logprob_diff=0.0,
        shared_prefix_mean_abs_logprob_diff=0.0,
        clip_fraction=0.0,
        outside_top_p_per_thousand=0.0,
        tokens=64,
    )
    core = client.CoreV1Api(kube)
    client.CoreV1Api(pod_client(kube, restricted, checker)).patch_namespaced_pod(
        checker, restricted, {"metadata": {"annotations": {keys.PREFLIGHT: document(result)}}}
    )
    core.patch_namespaced_pod_status(checker, restricted, {"status": {"phase": "Succeeded"}})

    def running() -> bool:
        job = get_job(kube, restricted, "guarded")
        ready = condition(job, "Ready")
        assert ready.get("reason") != "ChildRejected", ready["message"]
        return phase(job) == "Running"

    wait_for(running, "the job to run in the restricted namespace")
    names = [pod.metadata.name for pod in job_pods(kube, restricted, "guarded") if not pod.metadata.deletion_timestamp]
    assert names == ["guarded-actor-0", "guarded-actor-1", "guarded-trainer-0"]
