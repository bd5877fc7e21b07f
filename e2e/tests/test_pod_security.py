"""Pod Security: every pod Lockstep creates is admitted where a namespace enforces the "restricted" level (the
local API server runs the PodSecurity admission plugin, as every cluster does by default)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from lockstep import desired, keys
from lockstep.api import RLJobSpec
from lockstep.parity import default_policy, effective_config
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


def test_the_pods_of_actor_groups_meet_pod_security_restricted_and_their_set_keeps_every_field(
    kube: client.ApiClient, restricted: str
) -> None:
    """A job whose actors are groups (spec.actors.group): the StatefulSet controller creates its LeaderWorkerSet's
    pods where Pod Security enforces "restricted", and the set the API server stored holds every field the operator
    rendered (LeaderWorkerSet's CRD prunes a field it does not know, silently)."""
    job = rljob("grouped", actors=2, weightSync={"backend": "gloo"})
    job["spec"]["actors"]["group"] = {"pods": 2, "tensorParallelSize": 2}
    created = create_job(kube, restricted, job)
    names = {"grouped-actor-0", "grouped-actor-0-1", "grouped-actor-1", "grouped-actor-1-1", "grouped-trainer-0"}

    def group_pods_exist() -> bool:
        ready = condition(get_job(kube, restricted, "grouped"), "Ready")
        assert ready.get("reason") != "ChildRejected", ready["message"]
        return {pod.metadata.name for pod in job_pods(kube, restricted, "grouped")} == names

    wait_for(group_pods_exist, f"the pods {sorted(names)}", timeout=90)
    spec = RLJobSpec.model_validate(job["spec"])
    ref = desired.JobRef("grouped", restricted, created["metadata"]["uid"])
    rendered = desired.actor_groups(ref, spec, effective_config(spec, default_policy()))
    stored = client.CustomObjectsApi(kube).get_namespaced_custom_object(
        desired.LEADER_WORKER_SET_GROUP,
        desired.LEADER_WORKER_SET_VERSION,
        restricted,
        desired.LEADER_WORKER_SETS,
        desired.actor_set_name("grouped"),
    )
    assert _holds(stored["spec"], rendered["spec"]), "the API server pruned a field LeaderWorkerSet does not know"


def _holds(stored: Any, sent: Any) -> bool:
    """Whether ``stored`` has every field of ``sent`` with its value (the API server may add defaults)."""
    if isinstance(sent, dict):
        return isinstance(stored, dict) and all(key in stored and _holds(stored[key], sent[key]) for key in sent)
    if isinstance(sent, list):
        return isinstance(stored, list) and len(stored) == len(sent) and all(map(_holds, stored, sent))
    return bool(stored == sent)
