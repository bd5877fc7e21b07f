"""Pod Security: every pod Lockstep creates is admitted where a namespace enforces the "restricted" level (the
local API server runs the PodSecurity admission plugin, as every cluster does by default)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from kubernetes import client

from lockstep import desired, keys
from lockstep.api import RLJobSpec
from lockstep.parity import default_policy, effective_config
from lockstep.protocol import PreflightResult, document
from lockstep_e2e import build
from lockstep_e2e.fixtures import fresh_namespace, wait_for
from lockstep_e2e.install import apply, pod_client
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


def test_an_actor_group_is_a_leader_worker_set_its_crd_accepts_with_pods_that_meet_restricted(
    kube: client.ApiClient, restricted: str
) -> None:
    """spec.actors.group's LeaderWorkerSet (lockstep.desired.actor_groups; not yet applied by the operator,
    docs/actor-groups.md) against LeaderWorkerSet's own CRD at the pinned version, and a pod of each of its
    templates, named as LeaderWorkerSet names them, where Pod Security enforces "restricted"."""
    crd_file = build.lws_module() / "config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml"
    apply(kube, [yaml.safe_load(crd_file.read_text())])
    body = rljob("grouped", actors=2, weightSync={"backend": "gloo"})["spec"]
    body["actors"]["group"] = {"pods": 2, "tensorParallelSize": 2}
    spec = RLJobSpec.model_validate(body)
    job = desired.JobRef("grouped", restricted, "uid-grouped")
    group_set = desired.actor_groups(job, spec, effective_config(spec, default_policy()))
    created = client.CustomObjectsApi(kube).create_namespaced_custom_object(
        "leaderworkerset.x-k8s.io", "v1", restricted, "leaderworkersets", group_set, dry_run="All"
    )
    assert _holds(created["spec"], group_set["spec"]), "the API server pruned a field LeaderWorkerSet does not know"
    templates = group_set["spec"]["leaderWorkerTemplate"]
    core = client.CoreV1Api(kube)
    core.create_namespaced_service_account(restricted, {"metadata": {"name": desired.worker_account_name(job.name)}})
    named = {"grouped-actor-0": templates["leaderTemplate"], "grouped-actor-0-1": templates["workerTemplate"]}
    for name, template in named.items():
        # Without the managed-by label, which the barrier's admission policy lets only the operator set (StatefulSet's
        # controller, which creates a LeaderWorkerSet's pods, is refused it: docs/actor-groups.md, "Not built yet").
        labels = {key: value for key, value in template["metadata"]["labels"].items() if key != keys.MANAGED_BY}
        metadata = {**template["metadata"], "labels": labels, "name": name}
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": metadata}
        core.create_namespaced_pod(restricted, pod | {"spec": template["spec"]}, dry_run="All")


def _holds(stored: Any, sent: Any) -> bool:
    """Whether ``stored`` has every field of ``sent`` with its value (the API server may add defaults)."""
    if isinstance(sent, dict):
        return isinstance(stored, dict) and all(key in stored and _holds(stored[key], sent[key]) for key in sent)
    if isinstance(sent, list):
        return isinstance(stored, list) and len(stored) == len(sent) and all(map(_holds, stored, sent))
    return bool(stored == sent)
