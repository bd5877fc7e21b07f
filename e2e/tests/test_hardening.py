"""What one bad ack, one bad job, ordinary edits and faults do to the operator, on the real control plane.

Each test reproduces a report of the hardening review (the operator used to fail it) and shows what happens now.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines

from lockstep import admission, api, environment, keys
from lockstep.api.output import OUTPUT_PATH_WHY, USER_INFO_WHY
from lockstep.events import PassScope
from lockstep.protocol import PROTOCOL
from lockstep_e2e.agents import running_agents
from lockstep_e2e.fixtures import push_weights, running_job, wait_for, weights_version
from lockstep_e2e.install import apply, pod_client, service_account_token, token_client
from lockstep_e2e.jobs import (
    POLICIES,
    announce_weights,
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


def barrier_of(kube: client.ApiClient, namespace: str, job: str) -> dict[str, Any]:
    return dict(get_job(kube, namespace, job)["status"].get("barrier") or {})


def command_on(kube: client.ApiClient, namespace: str, pod: str) -> dict[str, Any]:
    annotations = client.CoreV1Api(kube).read_namespaced_pod(pod, namespace).metadata.annotations or {}
    return dict(json.loads(annotations.get(keys.BARRIER, "{}")))


def ack_as(kube: client.ApiClient, namespace: str, pod: str, **ack: Any) -> None:
    """Write ``ack`` on ``pod`` with a token bound to that pod, as its agent would."""
    text = json.dumps({"protocol": PROTOCOL, **ack})
    client.CoreV1Api(pod_client(kube, namespace, pod)).patch_namespaced_pod(
        pod, namespace, {"metadata": {"annotations": {keys.BARRIER_ACK: text}}}
    )


UNTOLERABLE = [{"key": "gpu", "operator": "Sometimes"}]
"""Tolerations the RLJob schema passes through (a core type) and the API server refuses on a pod."""


def parity_policy(name: str) -> dict[str, Any]:
    """The smallest coherent ParityPolicy (Enforce, not the default)."""
    spec = {"vllm": {"enablePrefixCaching": False}}
    return {"apiVersion": api.API_VERSION, "kind": "ParityPolicy", "metadata": {"name": name}, "spec": spec}


def uids(kube: client.ApiClient, namespace: str, job: str) -> dict[str, str]:
    """The job's pods that are not being deleted: name → UID."""
    pods = job_pods(kube, namespace, job)
    return {p.metadata.name: p.metadata.uid for p in pods if not p.metadata.deletion_timestamp}


def test_one_error_ack_concerns_that_actor_alone(kube: client.ApiClient, namespace: str) -> None:
    body = rljob("flaky", actors=4, weightSync={"barrierTimeoutSeconds": 300, "onTimeout": "EvictStraggler"})
    create_job(kube, namespace, body)
    wait_for(lambda: phase(get_job(kube, namespace, "flaky")) == "Running", "RLJob flaky to run")
    before = uids(kube, namespace, "flaky")
    announce_weights(kube, namespace, "flaky", 1)
    wait_for(lambda: barrier_of(kube, namespace, "flaky").get("phase") == "Update", "the barrier to open")
    barrier_id = barrier_of(kube, namespace, "flaky")["id"]
    ack_as(kube, namespace, "flaky-actor-0", id=barrier_id, phase="Updated", loadedVersion=1)
    ack_as(kube, namespace, "flaky-actor-1", id=barrier_id, phase="Updated", error="transient")
    wait_for(lambda: command_on(kube, namespace, "flaky-actor-1").get("retry") == 1, "actor 1 to be asked again")
    wait_for(lambda: any("retry 1 of 2" in e.message for e in events_for(kube, namespace, "flaky")), "the Event")
    assert uids(kube, namespace, "flaky") == before, "nobody was evicted for actor 1's error"
    assert set(barrier_of(kube, namespace, "flaky")["members"]) == set(before) - {"flaky-trainer-0"}

    with running_agents(kube, namespace, [f"flaky-actor-{i}" for i in range(4)]) as engines:
        wait_for(lambda: weights_version(kube, namespace, "flaky") == 1, "the update with every actor")
    assert all(engine.calls == ["stage 1", "pause", "swap 1", "resume"] for engine in engines.values())
    record = get_job(kube, namespace, "flaky")["status"]["barrierHistory"][-1]
    assert record["outcome"] == "Completed" and record["members"] == 4 and not record["evicted"]
    assert uids(kube, namespace, "flaky") == before


def test_spec_edits_replace_pods_without_spending_restarts(kube: client.ApiClient, namespace: str) -> None:
    create_job(kube, namespace, rljob("edited", actors=2, maxRestarts=1))
    wait_for(lambda: phase(get_job(kube, namespace, "edited")) == "Running", "RLJob edited to run")
    for edit in range(3):
        old = uids(kube, namespace, "edited")
        patch_job(kube, namespace, "edited", {"spec": {"actors": {"image": f"lockstep/actor:edit-{edit}"}}})

        def replaced(old: dict[str, str] = old) -> bool:
            now = uids(kube, namespace, "edited")
            actors = [n for n in now if "actor" in n]
            job = get_job(kube, namespace, "edited")
            fresh = len(actors) == 2 and all(now[n] != old.get(n) for n in actors)
            return fresh and phase(job) == "Running" and condition(job, "Ready")["status"] == "True"

        wait_for(replaced, f"edit {edit + 1}'s actors to run", timeout=90)
    status = get_job(kube, namespace, "edited")["status"]
    assert status["restarts"] == 0 and status["replacements"] == 6, status
    assert not status.get("replacing")


def test_a_job_without_actors_is_refused(kube: client.ApiClient, namespace: str) -> None:
    body = rljob("empty", actors=1)
    body["spec"]["actors"]["replicas"] = 0
    with pytest.raises(client.ApiException) as refused:
        create_job(kube, namespace, body)
    message = json.loads(refused.value.body)["message"]
    assert "spec.actors.replicas in body should be greater than or equal to 1" in message


@pytest.fixture
def two_namespaces(kube: client.ApiClient) -> Iterator[tuple[str, str]]:
    """Namespaces whose jobs the API server lists in this order (a-..., then b-...)."""
    core = client.CoreV1Api(kube)
    suffix = uuid.uuid4().hex[:6]
    names = (f"a-poison-{suffix}", f"b-victim-{suffix}")
    for name in names:
        core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    yield names
    for name in names:
        core.delete_namespace(name)


def test_one_bad_job_never_keeps_a_policy_change_from_the_others(
    kube: client.ApiClient, two_namespaces: tuple[str, str]
) -> None:
    poison_ns, victim_ns = two_namespaces
    custom = client.CustomObjectsApi(kube)
    name = f"lockdown-{uuid.uuid4().hex[:6]}"
    custom.create_cluster_custom_object(*POLICIES, parity_policy(name))
    try:
        poison = rljob("poison", actors=1, parityPolicy=name)
        poison["spec"]["actors"]["tolerations"] = UNTOLERABLE
        create_job(kube, poison_ns, poison)
        create_job(kube, victim_ns, rljob("victim", actors=1, parityPolicy=name, vllm={"seed": 1}))
        wait_for(lambda: phase(get_job(kube, victim_ns, "victim")) == "Running", "the victim to run")
        wait_for(
            lambda: condition(get_job(kube, poison_ns, "poison"), "Ready").get("reason") == "ChildRejected",
            "the poison job to say what the API server refused",
        )
        custom.patch_cluster_custom_object(*POLICIES, name, {"spec": {"vllm": {"seed": 7}}})
        wait_for(
            lambda: (
                condition(get_job(kube, victim_ns, "victim"), "ParityLocked").get("reason") == "ConflictsWithPolicy"
            ),
            "the victim to see the policy change (well before the 60 s resync)",
            timeout=20,
        )
    finally:
        custom.delete_cluster_custom_object(*POLICIES, name)


def test_a_pass_that_raises_for_one_job_leaves_the_next_job_its_pass(
    kube: client.ApiClient, two_namespaces: tuple[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    """request_all (the resync, and every policy change) gives each job a pass of its own: a pass that raises, for
    a fault no check foresaw, is logged with the job's name, and the jobs listed after it still get theirs. The
    shell runs as the operator's service account; its passes only record and fail, so the running operator keeps
    the jobs."""
    from lockstep.controller import JobKey, Shell

    first, second = two_namespaces
    create_job(kube, first, rljob("poison", actors=1))
    create_job(kube, second, rljob("victim", actors=1))
    passes: list[JobKey] = []

    class UnluckyShell(Shell):
        def _reconcile_once(self, key: JobKey, scope: PassScope) -> None:
            passes.append(key)
            if key == (first, "poison"):
                raise RuntimeError("a fault no check foresaw")

    token = service_account_token(kube, keys.OPERATOR_NAMESPACE, keys.OPERATOR_SERVICE_ACCOUNT, seconds=600)
    with caplog.at_level("ERROR", logger="lockstep.controller"):
        UnluckyShell(token_client(kube, token)).request_all()
    assert passes.index((first, "poison")) < passes.index((second, "victim")), "the API server lists a- before b-"
    assert f"reconciling RLJob {first}/poison failed" in caplog.text


def test_what_the_api_server_refuses_to_create_is_a_condition_and_an_event(
    kube: client.ApiClient, namespace: str
) -> None:
    body = rljob("intolerant", actors=1)
    body["spec"]["actors"]["tolerations"] = UNTOLERABLE
    create_job(kube, namespace, body)
    wait_for(
        lambda: condition(get_job(kube, namespace, "intolerant"), "Ready").get("reason") == "ChildRejected",
        "the ChildRejected condition",
    )
    job = get_job(kube, namespace, "intolerant")
    ready = condition(job, "Ready")
    assert ready["status"] == "False" and "Pod intolerant-actor-0" in ready["message"]
    assert "spec.tolerations[0].operator" in ready["message"] and "fix the RLJob's spec" in ready["message"]
    assert condition(job, "Stalled")["status"] == "True"
    wait_for(  # the Event is posted once the status write it describes succeeded, a moment after it
        lambda: any(
            e.reason == "ChildRejected" and e.type == "Warning" for e in events_for(kube, namespace, "intolerant")
        ),
        "the ChildRejected Warning Event",
        timeout=10,
    )
    assert "intolerant-actor-0" not in uids(kube, namespace, "intolerant")

    patch_job(kube, namespace, "intolerant", {"spec": {"actors": {"tolerations": [{"operator": "Exists"}]}}})
    wait_for(lambda: phase(get_job(kube, namespace, "intolerant")) == "Running", "the fixed job to run")


def test_a_job_that_a_resource_quota_admits_in_part_releases_the_pods_it_got(
    kube: client.ApiClient, namespace: str
) -> None:
    core = client.CoreV1Api(kube)
    quota = {"metadata": {"name": "two-pods"}, "spec": {"hard": {"count/pods": "2"}}}
    core.create_namespaced_resource_quota(namespace, quota)
    wait_for(  # the quota admits nothing until the controller manager has counted what it covers
        lambda: (core.read_namespaced_resource_quota("two-pods", namespace).status.hard or {}).get("count/pods"),
        "the ResourceQuota to be counted",
    )
    create_job(kube, namespace, rljob("partial", actors=2))  # three pods
    wait_for(
        lambda: condition(get_job(kube, namespace, "partial"), "Ready").get("reason") == "QuotaExceeded",
        "the QuotaExceeded condition",
    )
    job = get_job(kube, namespace, "partial")
    ready = condition(job, "Ready")
    assert "ResourceQuota two-pods" in ready["message"] and "Kueue" in ready["message"]
    assert condition(job, "Stalled")["status"] == "False", "it waits for quota: nothing for a person to fix"
    wait_for(lambda: not job_pods(kube, namespace, "partial"), "the pods it got to be released")
    wait_for(  # the Event is posted once the status write it describes succeeded, a moment after it
        lambda: any(
            e.reason == "QuotaExceeded" and e.type == "Warning" for e in events_for(kube, namespace, "partial")
        ),
        "the QuotaExceeded Warning Event",
        timeout=10,
    )

    core.patch_namespaced_resource_quota("two-pods", namespace, {"spec": {"hard": {"count/pods": "3"}}})
    wait_for(  # it tries again on the operator's resync, every minute
        lambda: phase(get_job(kube, namespace, "partial")) == "Running", "the job to run with every pod", timeout=150
    )


def test_deleted_children_come_back_while_the_operator_runs(kube: client.ApiClient, namespace: str) -> None:
    actors = running_job(kube, namespace, "pruned", 1)
    core, rbac = client.CoreV1Api(kube), client.RbacAuthorizationV1Api(kube)
    networking = client.NetworkingV1Api(kube)
    core.delete_namespaced_config_map("pruned-config", namespace)
    core.delete_namespaced_service("pruned-actors", namespace)
    rbac.delete_namespaced_role("pruned-worker", namespace)
    networking.delete_namespaced_network_policy("pruned-isolation", namespace)

    def back(read: Any, name: str) -> bool:
        try:
            return read(name, namespace).metadata.deletion_timestamp is None
        except client.ApiException as error:
            assert error.status == 404
            return False

    for read, name in (
        (core.read_namespaced_service, "pruned-actors"),
        (rbac.read_namespaced_role, "pruned-worker"),
        (networking.read_namespaced_network_policy, "pruned-isolation"),
    ):
        wait_for(lambda read=read, name=name: back(read, name), f"{name} to be re-created", timeout=15)
    push_weights(kube, namespace, "pruned", actors, 1)  # the pods may write their acks again
    # A new pod needs the ConfigMap: it is applied again before any pod is created.
    core.delete_namespaced_pod(actors[0], namespace)
    wait_for(lambda: back(core.read_namespaced_config_map, "pruned-config"), "the ConfigMap before the new pod")


def test_an_open_barrier_ends_by_its_deadline_while_no_policy_resolves(kube: client.ApiClient, namespace: str) -> None:
    custom = client.CustomObjectsApi(kube)
    name = f"fleeting-{uuid.uuid4().hex[:6]}"
    custom.create_cluster_custom_object(*POLICIES, parity_policy(name))
    body = rljob("orphaned", actors=2, parityPolicy=name, weightSync={"barrierTimeoutSeconds": 5})
    create_job(kube, namespace, body)
    wait_for(lambda: phase(get_job(kube, namespace, "orphaned")) == "Running", "RLJob orphaned to run")
    announce_weights(kube, namespace, "orphaned", 1)
    wait_for(lambda: barrier_of(kube, namespace, "orphaned").get("phase") == "Update", "the barrier to open")
    custom.delete_cluster_custom_object(*POLICIES, name)
    wait_for(lambda: phase(get_job(kube, namespace, "orphaned")) == "Failed", "the barrier's deadline", timeout=30)
    job = get_job(kube, namespace, "orphaned")
    assert condition(job, "ParityLocked")["reason"] == "PolicyNotFound"
    assert condition(job, "Ready")["reason"] == "WeightUpdateFailed"
    wait_for(lambda: not uids(kube, namespace, "orphaned"), "no actor left paused: the pods are deleted")


def test_announcements_older_than_committed_or_from_elsewhere_are_refused_once(
    kube: client.ApiClient, namespace: str
) -> None:
    actors = running_job(kube, namespace, "rewound", 1)
    push_weights(kube, namespace, "rewound", actors, 3)
    announce_weights(kube, namespace, "rewound", 2)

    def refusals() -> list[str]:
        return [e.message for e in events_for(kube, namespace, "rewound") if e.reason == "InvalidWeightsAnnouncement"]

    wait_for(lambda: len(refusals()) == 1, "an Event for the rewound announcement")
    assert "older than the committed version 3" in refusals()[0]  # the only one so far
    patch_job(kube, namespace, "rewound", {"metadata": {"labels": {"touched": "yes"}}})  # more passes
    wait_for(lambda: get_job(kube, namespace, "rewound")["status"].get("refusedAnnouncement"), "the status to say so")
    status = get_job(kube, namespace, "rewound")["status"]
    assert status.get("lag") is None or status["lag"] >= 0, "never a negative lag"
    assert len(refusals()) == 1, "reported once, not on every pass"

    # Issue 21 item 4: weights from anywhere but the job's own weights directory, however the URI is spelled.
    uid = get_job(kube, namespace, "rewound")["metadata"]["uid"]
    other = str(uuid.uuid4())
    forged = [
        f"file:///etc/{uid}/passwd",
        f"file:///var/lib/lockstep/{other}/{uid}/v1",
        f"file://evil.example/var/lib/lockstep/{uid}/weights/v4.safetensors",
        f"file:/var/lib/lockstep/{uid}/weights/v4.safetensors",
        f"FILE:///var/lib/lockstep/{uid}/weights/v4.safetensors",
    ]
    trainer = client.CoreV1Api(pod_client(kube, namespace, "rewound-trainer-0"))
    for count, uri in enumerate(forged, start=2):
        evil = {"protocol": PROTOCOL, "version": 4, "uri": uri, "digest": "sha256:4"}
        trainer.patch_namespaced_pod(
            "rewound-trainer-0", namespace, {"metadata": {"annotations": {keys.WEIGHTS: json.dumps(evil)}}}
        )
        wait_for(lambda count=count: len(refusals()) == count, f"an Event for weights at {uri}")
        [message] = [message for message in refusals() if uri in message]
        assert "the job takes weights only from files in its weights directory" in message, message
        assert get_job(kube, namespace, "rewound")["status"]["refusedAnnouncement"] == json.dumps(evil)
    assert not barrier_of(kube, namespace, "rewound") and weights_version(kube, namespace, "rewound") == 3


def test_each_job_is_isolated_by_its_own_network_policy(kube: client.ApiClient, namespace: str) -> None:
    running_job(kube, namespace, "left", 1)
    running_job(kube, namespace, "right", 1)
    networking, core = client.NetworkingV1Api(kube), client.CoreV1Api(kube)

    def selected(selector: client.V1LabelSelector) -> set[str]:
        labels = ",".join(f"{k}={v}" for k, v in selector.match_labels.items())
        return {p.metadata.name for p in core.list_namespaced_pod(namespace, label_selector=labels).items}

    isolation = networking.read_namespaced_network_policy("left-isolation", namespace)
    left = {"left-actor-0", "left-trainer-0"}
    assert selected(isolation.spec.pod_selector) == left, "it applies to the job's own pods"
    assert isolation.spec.policy_types == ["Ingress"]
    [own] = isolation.spec.ingress
    assert own.ports is None, "every port: gloo and NCCL pick ephemeral ones"
    assert selected(own._from[0].pod_selector) == left, "and admits only them, not the other job's pods"

    patch_job(kube, namespace, "left", {"spec": {"networkPolicy": {"enabled": False}}})

    def removed() -> bool:
        return not networking.list_namespaced_network_policy(namespace, label_selector=f"{keys.JOB}=left").items

    wait_for(removed, "the policy to go when the job turns it off")
    assert networking.read_namespaced_network_policy("right-isolation", namespace)


def name_taken(kube: client.ApiClient, namespace: str, job: str) -> dict[str, Any]:
    """The job's Ready condition once it says that a pod not labelled as the job's holds one of its pod names."""
    wait_for(lambda: condition(get_job(kube, namespace, job), "Ready").get("reason") == "PodNameTaken", "PodNameTaken")
    wait_for(  # the Event is posted once the status write it describes succeeded, a moment after it
        lambda: any(e.reason == "PodNameTaken" and e.type == "Warning" for e in events_for(kube, namespace, job)),
        "the PodNameTaken Warning Event",
        timeout=10,
    )
    return condition(get_job(kube, namespace, job), "Ready")


def test_a_pod_that_squats_a_jobs_pod_name_is_named_in_the_jobs_condition_and_an_event(
    kube: client.ApiClient, namespace: str
) -> None:
    """Issue 21 item 6: a user with edit in the namespace creates <job>-trainer-0 before the job exists."""
    core = client.CoreV1Api(kube)
    core.create_namespaced_service_account(namespace, {"metadata": {"name": "squatter"}})
    client.RbacAuthorizationV1Api(kube).create_namespaced_role_binding(
        namespace,
        {
            "metadata": {"name": "squatter-edit"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "edit"},
            "subjects": [{"kind": "ServiceAccount", "name": "squatter", "namespace": namespace}],
        },
    )
    squatter = client.CoreV1Api(token_client(kube, service_account_token(kube, namespace, "squatter", seconds=600)))
    pod = {
        "metadata": {"name": "squatted-trainer-0"},
        "spec": {"containers": [{"name": "main", "image": "busybox"}]},
    }
    wait_for(
        lambda: _once_rbac_allows(lambda: squatter.create_namespaced_pod(namespace, pod)),
        "the edit role to let the squatter create a pod",
    )
    create_job(kube, namespace, rljob("squatted", actors=1))
    ready = name_taken(kube, namespace, "squatted")
    assert ready["status"] == "False" and phase(get_job(kube, namespace, "squatted")) == "Pending"
    assert "pod squatted-trainer-0 exists and is not Lockstep's" in ready["message"]
    assert "owned by nobody, written by " in ready["message"], "its managedFields name what created it"
    assert f"kubectl delete -n {namespace} pod squatted-trainer-0" in ready["message"]
    assert condition(get_job(kube, namespace, "squatted"), "Stalled")["status"] == "True"


def _once_rbac_allows(call: Callable[[], Any]) -> bool:
    """Make the call; False while RBAC still refuses it (a new RoleBinding reaches the authorizer a moment later)."""
    try:
        call()
    except ApiException as error:
        if error.status != 403:
            raise
        return False
    return True


def test_a_pod_relabelled_out_of_its_job_is_named_instead_of_waited_for(kube: client.ApiClient, namespace: str) -> None:
    """Issue 21 item 1's report: once an actor lost its managed-by label, the operator's re-create found its name
    taken (409) and the job waited, PodsNotReady, for ever."""
    from test_security import RBAC, impersonating, pod_rbac

    [actor] = running_job(kube, namespace, "relabelled", 1)
    group = {"kind": "Group", "name": keys.BREAK_GLASS_GROUP, "apiGroup": RBAC}
    apply(kube, pod_rbac(namespace, group, ["get", "patch"]))
    repair = client.CoreV1Api(impersonating(kube, "alice", keys.BREAK_GLASS_GROUP))
    unlabel = {"metadata": {"labels": {keys.MANAGED_BY: None}}}
    wait_for(
        lambda: _once_rbac_allows(lambda: repair.patch_namespaced_pod(actor, namespace, unlabel)),
        "the RoleBinding to let alice patch the pod",
    )
    ready = name_taken(kube, namespace, "relabelled")
    assert f"pod {actor} is this RLJob's own pod, but its labels no longer mark it as the job's" in ready["message"]


def test_weights_announced_while_a_barrier_resumes_open_the_next_one_as_it_closes(
    kube: client.ApiClient, namespace: str
) -> None:
    """Issue 21 item 8: trainer-0 announced version 2 while barrier 1 waited for its Resumed acks; the pass that
    announcement asked for found barrier 1 open, and the one that closed it opened nothing (a timer did, later)."""
    [actor] = running_job(kube, namespace, "wake", 1)
    announce_weights(kube, namespace, "wake", 1)
    wait_for(lambda: barrier_of(kube, namespace, "wake").get("phase") == "Update", "barrier 1's Update")
    barrier = barrier_of(kube, namespace, "wake")["id"]
    ack_as(kube, namespace, actor, id=barrier, phase="Updated", loadedVersion=1)
    wait_for(lambda: barrier_of(kube, namespace, "wake").get("phase") == "Resume", "barrier 1's Resume")
    announce_weights(kube, namespace, "wake", 2)
    wait_for(lambda: get_job(kube, namespace, "wake")["status"].get("lag") == 1, "the pass that sees version 2")
    assert barrier_of(kube, namespace, "wake")["id"] == barrier, "barrier 1 is still open: it waits for its ack"
    since = get_job(kube, namespace, "wake")["metadata"]["resourceVersion"]
    ack_as(kube, namespace, actor, id=barrier, phase="Resumed", loadedVersion=1)
    watch = client.CustomObjectsApi(kube).list_namespaced_custom_object(
        api.GROUP,
        api.VERSION,
        namespace,
        api.RLJOBS,
        field_selector="metadata.name=wake",
        watch=True,
        resource_version=since,
        timeout_seconds=60,
        _preload_content=False,
    )
    try:
        for line in iter_resp_lines(watch):
            status = json.loads(line)["object"].get("status") or {}
            if status.get("weightsVersion") == 1:
                break
        else:
            pytest.fail("barrier 1 did not close")
    finally:
        watch.close()
    assert (status.get("barrier") or {}).get("version") == 2, "the status write that closed barrier 1 opens barrier 2"


@pytest.mark.parametrize(
    "report",
    [
        {keys.MISMATCH: '{"protocol": 2, "step": 3, "meanAbsLogprobDiff": Infinity, "tokenFraction": 1.0}'},
        {keys.EVALUATION: '{"protocol": 2, "version": 1180591620717411303424, "reward": NaN, "rows": 20}'},
    ],
    ids=["infinite-mismatch", "nan-evaluation"],
)
def test_a_non_finite_trainer_report_is_named_and_the_weight_updates_go_on(
    kube: client.ApiClient, namespace: str, report: dict[str, str]
) -> None:
    """Issue 37 item 1: such a report made every status write fail (400 invalid JSON patch, or 422), with no
    condition and no Event, and barriers never committed; under onExceeded: Fail, Infinity deleted the pods."""
    actors = running_job(kube, namespace, "diverged", 1)
    client.CoreV1Api(pod_client(kube, namespace, "diverged-trainer-0")).patch_namespaced_pod(
        "diverged-trainer-0", namespace, {"metadata": {"annotations": report}}
    )
    push_weights(kube, namespace, "diverged", actors, 1)  # a barrier commits while the report stands
    wait_for(
        lambda: condition(get_job(kube, namespace, "diverged"), "TrainerReportsValid").get("status") == "False",
        "TrainerReportsValid=False",
    )
    [key] = report
    message = condition(get_job(kube, namespace, "diverged"), "TrainerReportsValid")["message"]
    assert message.startswith(f"{key} on the trainer is not a valid "), message
    events = [e.message for e in events_for(kube, namespace, "diverged") if e.reason == "InvalidTrainerReport"]
    assert events and f"{key} on the trainer" in events[0]
    assert phase(get_job(kube, namespace, "diverged")) == "Running"


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("volumeMounts", {"name": "lockstep-shared", "mountPath": "/mnt/all"}, "volume lockstep-shared belongs to"),
        (
            "volumeMounts",
            {"name": "lockstep-shared", "mountPath": "/mnt/other", "subPath": str(uuid.UUID(int=7))},
            "holds the weights of every job",
        ),
        (
            "env",
            {"name": "VLLM_ATTENTION_BACKEND", "value": "TORCH_SDPA"},
            "would change the numbers the actors or the trainer compute",
        ),
        ("env", {"name": "PYTHONPATH", "value": "/mnt/mine"}, "would change the code the workers load"),
    ],
    ids=["shared-volume-whole", "another-jobs-directory", "vllm-numerics", "pythonpath"],
)
def test_a_job_may_not_mount_the_operators_volumes_nor_set_numerics_or_code_variables(
    kube: client.ApiClient, namespace: str, field: str, value: dict[str, str], words: str
) -> None:
    """Issue 37 item 3 and its VLLM_*/PYTHONPATH risk: refused on create and on update, by the CRD itself."""
    body = rljob("overreach", actors=1)
    body["spec"]["actors"][field] = [value]
    with pytest.raises(ApiException) as refused:
        create_job(kube, namespace, body)
    assert refused.value.status == 422 and words in json.loads(refused.value.body)["message"]
    create_job(kube, namespace, rljob("overreach", actors=1))
    with pytest.raises(ApiException) as updated:
        patch_job(kube, namespace, "overreach", {"spec": {"actors": {field: [value]}}})
    assert updated.value.status == 422 and words in json.loads(updated.value.body)["message"]


SECRET_REF = {"secretKeyRef": {"name": "tracking", "key": "token"}}
ENV_PROBES = {
    "numerics": ("actors", {"name": "ONEDNN_DEFAULT_FPMATH_MODE", "value": "BF16"}, environment.NUMERICS_WHY),
    "tf32": ("trainer", {"name": "NVIDIA_TF32_OVERRIDE", "value": "1"}, environment.NUMERICS_WHY),
    "code-loading": ("actors", {"name": "LD_PRELOAD", "value": "/tmp/mine.so"}, environment.CODE_LOADING_WHY),
    "inline-credential": (
        "trainer",
        {"name": "AWS_SECRET_ACCESS_KEY", "value": "s3cret"},
        environment.CREDENTIAL_WHY,
    ),
    "credential-from-configmap": (
        "trainer",
        {"name": "MLFLOW_TRACKING_TOKEN", "valueFrom": {"configMapKeyRef": {"name": "tracking", "key": "token"}}},
        environment.CREDENTIAL_WHY,
    ),
}


def test_the_environment_lock_and_credentials_refuse_the_issues_probes(kube: client.ApiClient, namespace: str) -> None:
    """Issue 46 items 3 and 4 and the spec.output risk: ONEDNN_DEFAULT_FPMATH_MODE, NVIDIA_TF32_OVERRIDE,
    LD_PRELOAD, an inline AWS_SECRET_ACCESS_KEY, MLFLOW_TRACKING_TOKEN from a ConfigMap, a trackingUri with user info
    and an output path through .. are refused by the API server's CRD rules, each naming the variable and the fix;
    a variable on no list by the parity admission policy (the job's ParityPolicy may widen the list), until the job
    declares its prefix."""
    for role, variable, why in ENV_PROBES.values():
        body = rljob("probe", actors=1)
        body["spec"][role]["env"] = [variable]
        assert f"{variable['name']}{why}" in invalid(lambda body=body: create_job(kube, namespace, body))
    tracking = rljob("probe", actors=1, trainer={"tracking": {"mlflow": {"trackingUri": "https://u:s3cret@mlflow"}}})
    assert f"trackingUri{USER_INFO_WHY}" in invalid(lambda: create_job(kube, namespace, tracking))
    output = rljob("probe", actors=1, output={"path": "/models/../etc"})
    output["spec"]["trainer"]["volumeMounts"] = [{"name": "models", "mountPath": "/models"}]
    output["spec"]["trainer"]["volumes"] = [{"name": "models", "emptyDir": {}}]
    assert f"/models/../etc{OUTPUT_PATH_WHY}" in invalid(lambda: create_job(kube, namespace, output))

    unlisted = rljob("unlisted", actors=1)
    unlisted["spec"]["trainer"]["env"] = [
        {"name": "APP_SEED", "value": "7"},
        {"name": "MLFLOW_TRACKING_TOKEN", "valueFrom": SECRET_REF},
    ]
    message = refused_eventually(kube, namespace, {**unlisted, "metadata": {"generateName": "unlisted-"}})
    assert f"spec.trainer.env: APP_SEED{environment.UNLISTED_WHY}" in message, message
    status = client.AdmissionregistrationV1Api(kube).read_validating_admission_policy(admission.NAME).status
    assert status.type_checking is None or not status.type_checking.expression_warnings
    create_job(kube, namespace, {**unlisted, "spec": {**unlisted["spec"], "envPrefix": "APP_"}})
    wait_for(lambda: job_pods(kube, namespace, "unlisted") != [], "the job's pods, once it declares APP_")


def refused_eventually(kube: client.ApiClient, namespace: str, body: dict[str, Any]) -> str:
    """Create ``body`` (a generated name) until the parity admission policy refuses it: its informer may not have
    seen the default ParityPolicy yet, and an admitted copy is deleted at once. The refusal's message."""
    custom, args = client.CustomObjectsApi(kube), (api.GROUP, api.VERSION, namespace, api.RLJOBS)
    messages: list[str] = []

    def refuse() -> bool:
        try:
            created = custom.create_namespaced_custom_object(*args, body)
        except ApiException as error:
            messages.append(str(json.loads(error.body)["message"]))
            return True
        custom.delete_namespaced_custom_object(*args, created["metadata"]["name"])
        return False

    wait_for(refuse, "the parity admission policy to refuse the unlisted variable")
    return messages[-1]


def invalid(call: Callable[[], object]) -> str:
    """The API server's message for a request the CRD's rules refuse (422 Invalid)."""
    with pytest.raises(ApiException) as refused:
        call()
    assert refused.value.status == 422, refused.value.body
    return str(json.loads(refused.value.body)["message"])


def test_a_statefulset_that_squats_a_jobs_actor_is_refused_and_its_pod_is_never_a_member(
    kube: client.ApiClient, namespace: str
) -> None:
    """Issue 46 item 1: a user with edit makes a StatefulSet <job>-actor (ordinals.start 1) whose pods carry the job's
    labels and LeaderWorkerSet's, to have the StatefulSet controller create <job>-actor-1 for them. Admission refuses
    the StatefulSet; and one that gets past it (made here by break glass, as a stand-in for any admission gap) makes a
    pod that the operator names as a taken name, never counts, never commands and never deletes."""
    from test_security import RBAC, impersonating, refused

    from lockstep import admission

    core, rbac = client.CoreV1Api(kube), client.RbacAuthorizationV1Api(kube)
    core.create_namespaced_service_account(namespace, {"metadata": {"name": "squatter"}})
    edit = {"apiGroup": RBAC, "kind": "ClusterRole", "name": "edit"}
    rbac.create_namespaced_role_binding(
        namespace,
        {
            "metadata": {"name": "squatter-edit"},
            "roleRef": edit,
            "subjects": [
                {"kind": "ServiceAccount", "name": "squatter", "namespace": namespace},
                {"apiGroup": RBAC, "kind": "Group", "name": keys.BREAK_GLASS_GROUP},
            ],
        },
    )
    token = service_account_token(kube, namespace, "squatter", seconds=600)
    squatter = client.AppsV1Api(token_client(kube, token))
    labels = {
        keys.MANAGED_BY: keys.MANAGER,
        keys.JOB: "taken",
        keys.ROLE: keys.ACTOR,
        keys.GROUP_SET_NAME: "taken-actor",
        "app.kubernetes.io/instance": "taken",
        "leaderworkerset.sigs.k8s.io/worker-index": "0",  # a leader, to LeaderWorkerSet's pod webhook
    }

    def stateful_set(name: str, pod_labels: dict[str, str]) -> dict[str, Any]:
        return {
            "metadata": {"name": name},
            "spec": {
                "replicas": 1,
                "ordinals": {"start": 1},
                "serviceName": name,
                "selector": {"matchLabels": pod_labels},
                "template": {
                    "metadata": {"labels": pod_labels, "annotations": {"leaderworkerset.sigs.k8s.io/size": "1"}},
                    "spec": {"containers": [{"name": "main", "image": "busybox"}]},
                },
            },
        }

    plain = stateful_set("plain", {"app": "plain"})
    plain["spec"]["replicas"] = 0
    wait_for(
        lambda: _once_rbac_allows(lambda: squatter.create_namespaced_stateful_set(namespace, plain)),
        "the edit role to let the squatter create a StatefulSet",
    )
    message = refused(
        lambda: squatter.create_namespaced_stateful_set(namespace, stateful_set("taken-actor", labels)),
        admission.GROUP_SETS_POLICY,
    )
    assert message.startswith(
        f"the pod template of statefulsets {namespace}/taken-actor carries the label {keys.MANAGED_BY}={keys.MANAGER}"
    ), message
    assert message.endswith(f"not system:serviceaccount:{namespace}:squatter"), message

    glass = client.AppsV1Api(impersonating(kube, "e2e-repair", keys.BREAK_GLASS_GROUP))
    made = glass.create_namespaced_stateful_set(namespace, stateful_set("taken-actor", labels))
    wait_for(lambda: _exists(core, namespace, "taken-actor-1"), "the StatefulSet controller to create taken-actor-1")
    before = core.read_namespaced_pod("taken-actor-1", namespace)
    create_job(kube, namespace, rljob("taken", actors=2))
    ready = name_taken(kube, namespace, "taken")
    assert (
        f"pod taken-actor-1 wears this RLJob's labels but is not its own: owned by StatefulSet taken-actor (uid "
        f"{made.metadata.uid}), owned by nobody" in ready["message"]
    ), ready["message"]
    after = core.read_namespaced_pod("taken-actor-1", namespace)
    assert after.metadata.uid == before.metadata.uid and after.metadata.deletion_timestamp is None, "never deleted"
    assert keys.BARRIER not in (after.metadata.annotations or {}), "never commanded"
    assert "taken-actor-1" not in (get_job(kube, namespace, "taken")["status"].get("barrier") or {}).get("members", {})


def _exists(core: client.CoreV1Api, namespace: str, pod: str) -> bool:
    try:
        core.read_namespaced_pod(pod, namespace)
    except ApiException as error:
        if error.status != 404:
            raise
        return False
    return True
