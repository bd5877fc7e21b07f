"""The operator on the real local control plane: RLJobs become pods, and every way they change is handled."""

from __future__ import annotations

import contextlib
import json
import subprocess
import urllib.parse
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from lockstep import keys
from lockstep_e2e import build
from lockstep_e2e.cluster import LocalCluster
from lockstep_e2e.fixtures import wait_for
from lockstep_e2e.install import raw
from lockstep_e2e.jobs import (
    POLICIES,
    condition,
    create_job,
    events_for,
    get_job,
    job_pods,
    patch_job,
    phase,
    rljob,
)

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("lockstep")]


def wait_phase(kube: client.ApiClient, namespace: str, name: str, wanted: str, timeout: float = 60) -> dict[str, Any]:
    wait_for(lambda: phase(get_job(kube, namespace, name)) == wanted, f"RLJob {name} to be {wanted}", timeout)
    return get_job(kube, namespace, name)


def pod_names(kube: client.ApiClient, namespace: str, name: str) -> list[str]:
    return [p.metadata.name for p in job_pods(kube, namespace, name) if not p.metadata.deletion_timestamp]


def kubectl(cluster: LocalCluster, *args: str) -> str:
    result = subprocess.run(
        [str(build.bin_dir() / "kubectl"), f"--kubeconfig={cluster.kubeconfig}", *args],
        capture_output=True,
        text=True,
        check=False,
    )
    return result.stdout + result.stderr


def table_row(table: str) -> dict[str, str]:
    """The first row of ``kubectl get`` output, by column header (empty cells stay empty)."""
    header, row = table.splitlines()[:2]
    starts = [header.index(name) for name in header.split()]
    bounds = zip(starts, [*starts[1:], None], strict=True)
    return {name: row[start:end].strip() for name, (start, end) in zip(header.split(), bounds, strict=True)}


def refusal(call: Any) -> str:
    """The API server's message for a refused request."""
    with pytest.raises(ApiException) as refused:
        call()
    assert refused.value.status in (400, 422), refused.value.body
    return str(json.loads(refused.value.body)["message"])


def test_a_job_runs_with_pods_services_config_and_status(
    cluster: LocalCluster, kube: client.ApiClient, namespace: str
) -> None:
    create_job(kube, namespace, rljob("demo", actors=2, trainers=2))
    job = wait_phase(kube, namespace, "demo", "Running")
    status = job["status"]
    assert status["actors"] == {"desired": 2, "ready": 2, "summary": "2/2"}
    assert status["trainer"]["summary"] == "2/2"
    assert condition(job, "ParityLocked")["status"] == "True"
    assert condition(job, "Ready")["observedGeneration"] == job["metadata"]["generation"]
    assert status["parityPolicy"] == "default"

    pods = job_pods(kube, namespace, "demo")
    assert [p.metadata.name for p in pods] == ["demo-actor-0", "demo-actor-1", "demo-trainer-0", "demo-trainer-1"]
    for pod in pods:
        assert pod.metadata.annotations[keys.CONFIG_FINGERPRINT] == status["configFingerprint"]
        assert pod.metadata.owner_references[0].uid == job["metadata"]["uid"]
        assert pod.spec.node_name.startswith("kwok-node-")
    actor_args = pods[0].spec.containers[0].args
    assert "--logprobs-mode=processed_logprobs" in actor_args
    assert '--hf-overrides={"head_dtype":"float32"}' in actor_args
    rank1 = {e.name: e.value for e in pods[3].spec.containers[0].env}
    assert rank1["RANK"] == "1" and rank1["WORLD_SIZE"] == "2"
    assert rank1["MASTER_ADDR"] == f"demo-trainer-0.demo-trainer.{namespace}.svc"

    core = client.CoreV1Api(kube)
    assert core.read_namespaced_service("demo-trainer", namespace).spec.cluster_ip == "None"
    assert core.read_namespaced_service("demo-actors", namespace).spec.ports[0].port == 8000
    config = json.loads(core.read_namespaced_config_map("demo-config", namespace).data["effective-config.json"])
    assert config["fingerprint"] == status["configFingerprint"]
    assert config["vllm"]["enablePrefixCaching"] is False

    columns = table_row(kubectl(cluster, "get", "rljobs", "-n", namespace))
    assert list(columns) == ["NAME", "PHASE", "ACTORS", "TRAINER", "WEIGHTS", "QUEUE", "PARITY", "READY", "AGE"]
    assert columns["PHASE"] == "Running" and columns["ACTORS"] == "2/2" and columns["TRAINER"] == "2/2"
    assert columns["WEIGHTS"] == "" and columns["QUEUE"] == "" and columns["PARITY"] == "True"
    assert columns["READY"] == "True"


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"actors": {"image": "a", "replicas": -1}}, "spec.actors.replicas: Invalid value: -1"),
        ({"actors": {"image": "a", "replicas": 0}}, "spec.actors.replicas: Invalid value: 0"),
        (
            {"actors": {"image": "a", "resources": {"limits": {"cpu": "lots"}}}},
            'spec.actors.resources.limits.cpu: Invalid value: "lots"',
        ),
        ({"actors": {"image": "a", "env": [{"value": "x"}]}}, "spec.actors.env[0].name: Required value"),
        ({"actors": {"image": "a", "vllm": {"maxModelLen": "long"}}}, "spec.actors.vllm.maxModelLen: Invalid value"),
        ({"actors": {"image": "a", "vllm": {"gpuMemoryUtilization": 1.5}}}, "spec.actors.vllm.gpuMemoryUtilization"),
        ({"actors": {"replicas": 1}}, "spec.actors.image: Required value"),
        ({"trainer": {"image": "t", "objective": {"algorithm": "dpo"}}}, 'Unsupported value: "dpo"'),
        ({"weightSync": {"backend": "carrier-pigeon"}}, "spec.weightSync.backend: Unsupported value"),
        ({"weightSync": {"backend": "filesystem"}}, "spec.weightSync.volume is required with backend filesystem"),
        ({"trainer": {"image": "t", "reward": "rewards.py"}}, "spec.trainer.reward: Invalid value"),
        (
            {"trainer": {"image": "t", "reward": "m:f", "replicas": 4, "rollout": {"promptsPerStep": 2}}},
            "spec.trainer.rollout.promptsPerStep must be at least spec.trainer.replicas times",
        ),
        (
            {"trainer": {"image": "t", "reward": "m:f", "rollout": {"promptsPerStep": 2, "onPolicyGroups": 3}}},
            "spec.trainer.rollout.onPolicyGroups must be at most spec.trainer.rollout.promptsPerStep",
        ),
    ],
)
def test_invalid_jobs_are_refused_naming_the_field(
    kube: client.ApiClient, namespace: str, change: dict[str, Any], expected: str
) -> None:
    body = rljob("bad")
    body["spec"].update(change)
    message = refusal(lambda: create_job(kube, namespace, body))
    assert expected in message
    assert not job_pods(kube, namespace, "bad")


def test_a_name_too_long_for_pod_host_names_is_refused(kube: client.ApiClient, namespace: str) -> None:
    message = refusal(lambda: create_job(kube, namespace, rljob("x" * 46)))
    assert "metadata.name: at most 45 characters" in message
    message = refusal(lambda: create_job(kube, namespace, rljob("my.job")))
    assert "metadata.name: lower-case letters, digits and '-'" in message and "(no '.')" in message


def test_an_incoherent_policy_is_refused_with_the_reason(kube: client.ApiClient) -> None:
    policy = {
        "apiVersion": "lockstep.dev/v1alpha1",
        "kind": "ParityPolicy",
        "metadata": {"name": "stale-kv"},
        "spec": {"vllm": {"enablePrefixCaching": True}, "weightUpdate": {"clearCache": False}},
    }
    message = refusal(lambda: client.CustomObjectsApi(kube).create_cluster_custom_object(*POLICIES, policy))
    assert "spec.vllm.enablePrefixCaching" in message
    assert "reuse KV cache computed under the old weights" in message


def test_deleting_a_job_removes_its_children_without_finalizers(kube: client.ApiClient, namespace: str) -> None:
    core = client.CoreV1Api(kube)
    create_job(kube, namespace, rljob("doomed", actors=2))
    job = wait_phase(kube, namespace, "doomed", "Running")
    assert not job["metadata"].get("finalizers")
    client.CustomObjectsApi(kube).delete_namespaced_custom_object(
        "lockstep.dev", "v1alpha1", namespace, "rljobs", "doomed"
    )

    def children_gone() -> bool:
        selector = "lockstep.dev/job=doomed"
        return not (
            core.list_namespaced_pod(namespace, label_selector=selector).items
            or core.list_namespaced_service(namespace, label_selector=selector).items
            or core.list_namespaced_config_map(namespace, label_selector=selector).items
        )

    wait_for(children_gone, "the garbage collector to delete the deleted job's pods, services and config")


def test_immutable_fields_cannot_change(kube: client.ApiClient, namespace: str) -> None:
    create_job(kube, namespace, rljob("fixed"))
    message = refusal(lambda: patch_job(kube, namespace, "fixed", {"spec": {"model": {"uri": "/models/other"}}}))
    assert "spec.model is immutable while the RLJob exists" in message
    message = refusal(lambda: patch_job(kube, namespace, "fixed", {"spec": {"weightSync": {"backend": "nccl"}}}))
    assert "spec.weightSync.backend is immutable while the RLJob exists" in message
    assert get_job(kube, namespace, "fixed")["spec"]["model"]["uri"] == "/models/tiny-llama"


def test_unknown_policy_is_a_condition_and_no_pods(kube: client.ApiClient, namespace: str) -> None:
    create_job(kube, namespace, rljob("orphan", parityPolicy="does-not-exist"))
    wait_for(
        lambda: condition(get_job(kube, namespace, "orphan"), "ParityLocked").get("reason") == "PolicyNotFound",
        "the PolicyNotFound condition",
    )
    parity = condition(get_job(kube, namespace, "orphan"), "ParityLocked")
    assert parity["status"] == "False"
    assert "ParityPolicy 'does-not-exist' does not exist" in parity["message"]
    assert not job_pods(kube, namespace, "orphan")
    assert any(e.reason == "PolicyNotFound" and e.type == "Warning" for e in events_for(kube, namespace, "orphan"))


@pytest.fixture
def policy_named(kube: client.ApiClient, namespace: str) -> Iterator[Callable[..., str]]:
    """``policy_named(enforcement, **vllm)`` creates a ParityPolicy for this test and returns its name."""
    custom = client.CustomObjectsApi(kube)
    created: list[str] = []

    def create(enforcement: str, **vllm: Any) -> str:
        name = f"{enforcement.lower()}-{namespace}"[:60]
        body = {
            "apiVersion": "lockstep.dev/v1alpha1",
            "kind": "ParityPolicy",
            "metadata": {"name": name},
            "spec": {"enforcement": enforcement, "vllm": {"enablePrefixCaching": False, **vllm}},
        }
        custom.create_cluster_custom_object(*POLICIES, body)
        created.append(name)
        return name

    yield create
    for name in created:
        with contextlib.suppress(ApiException):
            custom.delete_cluster_custom_object(*POLICIES, name)


def test_warn_runs_the_locked_value_and_says_so(
    kube: client.ApiClient, namespace: str, policy_named: Callable[..., str]
) -> None:
    policy = policy_named("Warn", seed=1)
    create_job(kube, namespace, rljob("warned", actors=1, parityPolicy=policy, vllm={"seed": 7}))
    job = wait_phase(kube, namespace, "warned", "Running")
    parity = condition(job, "ParityLocked")
    assert (parity["status"], parity["reason"]) == ("True", "LockedValuesApplied")
    assert "spec.actors.vllm.seed=7 (locked to 1)" in parity["message"]
    assert "--seed=1" in job_pods(kube, namespace, "warned")[0].spec.containers[0].args
    warnings = [e for e in events_for(kube, namespace, "warned") if e.type == "Warning"]
    assert any(e.reason == "LockedValuesApplied" and "seed=7" in e.message for e in warnings)


def test_audit_only_records(kube: client.ApiClient, namespace: str, policy_named: Callable[..., str]) -> None:
    policy = policy_named("Audit", seed=1)
    create_job(kube, namespace, rljob("audited", actors=1, parityPolicy=policy, vllm={"seed": 7}))
    job = wait_phase(kube, namespace, "audited", "Running")
    parity = condition(job, "ParityLocked")
    assert (parity["status"], parity["reason"]) == ("False", "AuditOnly")
    assert "spec.actors.vllm.seed=7 (locked to 1)" in parity["message"]
    assert "--seed=7" in job_pods(kube, namespace, "audited")[0].spec.containers[0].args


def test_no_default_policy_is_a_condition_until_one_exists(kube: client.ApiClient, namespace: str) -> None:
    custom = client.CustomObjectsApi(kube)
    default = custom.get_cluster_custom_object(*POLICIES, "default")
    custom.delete_cluster_custom_object(*POLICIES, "default")
    try:
        create_job(kube, namespace, rljob("homeless", actors=1))
        wait_for(
            lambda: condition(get_job(kube, namespace, "homeless"), "ParityLocked").get("reason") == "NoDefaultPolicy",
            "the NoDefaultPolicy condition",
        )
        message = condition(get_job(kube, namespace, "homeless"), "ParityLocked")["message"]
        assert message.startswith("spec.parityPolicy is not set and no ParityPolicy has spec.default: true")
        assert not job_pods(kube, namespace, "homeless")
    finally:
        custom.create_cluster_custom_object(
            *POLICIES, {key: default[key] for key in ("apiVersion", "kind", "spec")} | {"metadata": {"name": "default"}}
        )
    wait_phase(kube, namespace, "homeless", "Running")


def test_policy_changes_and_deletion_while_jobs_use_it(
    kube: client.ApiClient, namespace: str, policy_named: Callable[..., str]
) -> None:
    custom = client.CustomObjectsApi(kube)
    name = policy_named("Enforce")
    create_job(kube, namespace, rljob("user", parityPolicy=name, vllm={"seed": 7}))
    wait_phase(kube, namespace, "user", "Running")

    # Tightened: the job's seed now conflicts; the job keeps no pods and says which key.
    custom.patch_cluster_custom_object(*POLICIES, name, {"spec": {"vllm": {"seed": 1}}})
    wait_for(lambda: not pod_names(kube, namespace, "user"), "the conflicting job's pods to be removed")
    # The pods are deleted before the status that says why is written.
    wait_for(
        lambda: condition(get_job(kube, namespace, "user"), "ParityLocked").get("reason") == "ConflictsWithPolicy",
        "ConflictsWithPolicy",
        timeout=10,
    )
    parity = condition(get_job(kube, namespace, "user"), "ParityLocked")
    assert "spec.actors.vllm.seed=7 (locked to 1)" in parity["message"]

    # Loosened again: pods come back.
    custom.patch_cluster_custom_object(*POLICIES, name, {"spec": {"vllm": {"seed": None}}})
    wait_phase(kube, namespace, "user", "Running")

    # Deleted: the pods keep running, the condition says why nothing new is created.
    custom.delete_cluster_custom_object(*POLICIES, name)
    wait_for(
        lambda: condition(get_job(kube, namespace, "user"), "ParityLocked").get("reason") == "PolicyNotFound",
        "PolicyNotFound after the policy was deleted",
    )
    message = condition(get_job(kube, namespace, "user"), "ParityLocked")["message"]
    assert "the 3 existing pods keep running with the last applied configuration" in message
    assert len(pod_names(kube, namespace, "user")) == 3


def test_scale_suspend_resume(kube: client.ApiClient, namespace: str) -> None:
    create_job(kube, namespace, rljob("elastic", actors=1))
    wait_phase(kube, namespace, "elastic", "Running")
    patch_job(kube, namespace, "elastic", {"spec": {"actors": {"replicas": 3}}})
    wait_for(lambda: get_job(kube, namespace, "elastic")["status"]["actors"]["summary"] == "3/3", "3 ready actors")
    patch_job(kube, namespace, "elastic", {"spec": {"actors": {"replicas": 2}}})
    wait_for(lambda: len([n for n in pod_names(kube, namespace, "elastic") if "-actor-" in n]) == 2, "2 actors")
    assert get_job(kube, namespace, "elastic")["status"]["restarts"] == 0

    patch_job(kube, namespace, "elastic", {"spec": {"suspend": True}})
    job = wait_phase(kube, namespace, "elastic", "Suspended")
    wait_for(lambda: not pod_names(kube, namespace, "elastic"), "the suspended job's pods to be deleted")
    assert job["status"]["configFingerprint"], "suspend keeps the status"
    patch_job(kube, namespace, "elastic", {"spec": {"suspend": False}})
    wait_phase(kube, namespace, "elastic", "Running")
    assert len(pod_names(kube, namespace, "elastic")) == 3


def test_lost_pods_are_recreated_until_max_restarts(kube: client.ApiClient, namespace: str) -> None:
    core = client.CoreV1Api(kube)
    create_job(kube, namespace, rljob("fragile", actors=2, maxRestarts=1))
    wait_phase(kube, namespace, "fragile", "Running")
    first_uid = core.read_namespaced_pod("fragile-actor-1", namespace).metadata.uid

    core.delete_namespaced_pod("fragile-actor-1", namespace)
    wait_for(lambda: get_job(kube, namespace, "fragile")["status"]["restarts"] == 1, "the first restart")
    wait_phase(kube, namespace, "fragile", "Running")
    wait_for(lambda: condition(get_job(kube, namespace, "fragile"), "Ready").get("status") == "True", "Ready again")
    assert core.read_namespaced_pod("fragile-actor-1", namespace).metadata.uid != first_uid

    # The second loss is a pod that failed (kwok leaves a Failed pod as it is).
    core.patch_namespaced_pod_status("fragile-actor-0", namespace, {"status": {"phase": "Failed"}})
    job = wait_phase(kube, namespace, "fragile", "Failed")
    ready = condition(job, "Ready")
    assert ready["reason"] == "RestartLimitExceeded"
    assert "the job already restarted 1 time(s) (spec.maxRestarts)" in ready["message"]
    wait_for(lambda: not pod_names(kube, namespace, "fragile"), "the failed job's pods to be deleted")


def test_a_pod_still_terminating_comes_back_once_gone_without_the_operator_listing_pods(
    cluster: LocalCluster, kube: client.ApiClient, namespace: str
) -> None:
    """A lost pod that takes its time to go (a finalizer) is created again once it is gone. Meanwhile each try
    finds it there (409), and the operator's cache, which has it, knows why: no LIST of the job's pods."""
    core = client.CoreV1Api(kube)
    create_job(kube, namespace, rljob("lingering", actors=1))
    wait_phase(kube, namespace, "lingering", "Running")
    pod = "lingering-actor-0"
    first_uid = core.read_namespaced_pod(pod, namespace).metadata.uid
    core.patch_namespaced_pod(pod, namespace, {"metadata": {"finalizers": ["test.lockstep.dev/hold"]}})
    seen = len(cluster.audit_events())
    core.delete_namespaced_pod(pod, namespace)

    def operator_requests(verb: str) -> list[dict[str, Any]]:
        return [
            e
            for e in cluster.audit_events()[seen:]
            if e["user"]["username"] == keys.OPERATOR_USERNAME
            and e["stage"] == "ResponseComplete"
            and e["verb"] == verb
            and e.get("objectRef", {}).get("resource") == "pods"
            and e.get("objectRef", {}).get("namespace") == namespace
        ]

    wait_for(
        lambda: any(e["responseStatus"]["code"] == 409 for e in operator_requests("create")),
        "the operator to try to create the pod while it terminates",
    )
    core.patch_namespaced_pod(pod, namespace, {"metadata": {"finalizers": None}})

    def came_back() -> bool:
        found = core.list_namespaced_pod(namespace, field_selector=f"metadata.name={pod}").items
        return bool(found) and found[0].metadata.uid != first_uid

    wait_for(came_back, "the pod to come back")
    assert not operator_requests("list"), "the cache knew the pod was terminating: nothing to list"


def test_a_pod_under_another_config_is_drift_and_replaced(kube: client.ApiClient, namespace: str) -> None:
    core = client.CoreV1Api(kube)
    create_job(kube, namespace, rljob("drifty", actors=1))
    wait_phase(kube, namespace, "drifty", "Running")
    old_uid = core.read_namespaced_pod("drifty-actor-0", namespace).metadata.uid
    core.patch_namespaced_pod(
        "drifty-actor-0", namespace, {"metadata": {"annotations": {keys.CONFIG_FINGERPRINT: "sha256:hand-edited"}}}
    )
    wait_for(lambda: any(e.reason == "Drift" for e in events_for(kube, namespace, "drifty")), "a Drift event")

    def replaced() -> bool:
        pods = [p for p in job_pods(kube, namespace, "drifty") if p.metadata.name == "drifty-actor-0"]
        return bool(pods) and pods[0].metadata.uid != old_uid and pods[0].status.phase == "Running"

    wait_for(replaced, "the drifted pod to be replaced")
    wait_for(
        lambda: condition(get_job(kube, namespace, "drifty"), "ParityLocked").get("reason") == "Locked",
        "ParityLocked=True again",
    )


def test_finished_job_is_deleted_after_its_ttl_with_all_children(kube: client.ApiClient, namespace: str) -> None:
    core = client.CoreV1Api(kube)
    create_job(kube, namespace, rljob("short", actors=1, ttlSecondsAfterFinished=2))
    wait_phase(kube, namespace, "short", "Running")
    core.patch_namespaced_pod_status("short-trainer-0", namespace, {"status": {"phase": "Succeeded"}})
    wait_phase(kube, namespace, "short", "Succeeded")

    def all_gone() -> bool:
        custom = client.CustomObjectsApi(kube)
        jobs = custom.list_namespaced_custom_object("lockstep.dev", "v1alpha1", namespace, "rljobs")["items"]
        return not jobs and not core.list_namespaced_config_map(namespace, label_selector="lockstep.dev/job").items

    wait_for(all_gone, "the finished job and its children to be deleted after ttlSecondsAfterFinished", timeout=90)


def test_operator_lists_and_watches_only_its_own_pods(
    cluster: LocalCluster, kube: client.ApiClient, namespace: str
) -> None:
    create_job(kube, namespace, rljob("watched", actors=1))
    wait_phase(kube, namespace, "watched", "Running")
    requests = [
        urllib.parse.urlsplit(e["requestURI"])
        for e in cluster.audit_events()
        if e["user"]["username"] == keys.OPERATOR_USERNAME
        and e["verb"] in ("list", "watch")
        and e.get("objectRef", {}).get("resource") == "pods"
    ]
    assert {"list", "watch"} <= {"watch" if "watch=true" in r.query else "list" for r in requests}
    for request in requests:
        selector = urllib.parse.parse_qs(request.query)["labelSelector"][0]
        assert keys.POD_SELECTOR in selector.split(","), request


def test_a_job_suspended_by_hand_resumes_with_the_node_selectors_set_meanwhile(
    kube: client.ApiClient, namespace: str
) -> None:
    """A person (or a queueing system that drives spec.suspend) creates a job suspended, sets node selectors while
    it waits, then lets it run by setting suspend to false; suspending it again deletes the pods. Kueue itself is
    tested in test_kueue.py."""
    create_job(kube, namespace, rljob("queued", actors=2, suspend=True))
    job = wait_phase(kube, namespace, "queued", "Suspended")
    assert not pod_names(kube, namespace, "queued"), "a suspended job holds no pods"
    assert condition(job, "Ready")["reason"] == "Suspended"

    flavor = {"cloud.example.com/accelerator": "h200"}
    patch_job(
        kube, namespace, "queued", {"spec": {"actors": {"nodeSelector": flavor}, "trainer": {"nodeSelector": flavor}}}
    )
    patch_job(kube, namespace, "queued", {"spec": {"suspend": False}})
    wait_for(lambda: len(pod_names(kube, namespace, "queued")) == 3, "the admitted job's pods")
    assert all(p.spec.node_selector == flavor for p in job_pods(kube, namespace, "queued"))

    patch_job(kube, namespace, "queued", {"spec": {"suspend": True}})
    wait_for(lambda: not pod_names(kube, namespace, "queued"), "the preempted job's pods to go")
    status = wait_phase(kube, namespace, "queued", "Suspended")["status"]
    assert status["restarts"] == 0 and status["configFingerprint"], "suspension is not a failure; status is kept"


def test_server_side_apply_by_two_managers_never_fights_the_operator(kube: client.ApiClient, namespace: str) -> None:
    """GitOps tools own the spec; the operator writes only status (the status subresource)."""
    custom = client.CustomObjectsApi(kube)

    def apply(manager: str, body: dict[str, Any]) -> dict[str, Any]:
        return dict(
            raw(
                custom.patch_namespaced_custom_object(
                    "lockstep.dev",
                    "v1alpha1",
                    namespace,
                    "rljobs",
                    "gitops",
                    body,
                    field_manager=manager,
                    _content_type="application/apply-patch+yaml",
                    _preload_content=False,
                )
            )
        )

    body = rljob("gitops", actors=1)
    apply("argocd", body)
    wait_phase(kube, namespace, "gitops", "Running")
    apply("argocd", body)  # a re-sync after the operator wrote status: no conflict
    apply(
        "kueue",
        {"apiVersion": body["apiVersion"], "kind": "RLJob", "metadata": {"name": "gitops"}, "spec": {"suspend": True}},
    )
    job = wait_phase(kube, namespace, "gitops", "Suspended")
    owners = {(m["manager"], m.get("subresource", "")) for m in job["metadata"]["managedFields"]}
    assert ("argocd", "") in owners and ("kueue", "") in owners
    operator_entries = [m for m in job["metadata"]["managedFields"] if m["manager"] not in ("argocd", "kueue")]
    assert operator_entries and all(m.get("subresource") == "status" for m in operator_entries), operator_entries
