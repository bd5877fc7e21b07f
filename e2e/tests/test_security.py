"""Who may change what on Lockstep's pods (crds/admission-barrier.yaml; docs/barrier-protocol.md, "Who may write
what"), attacked with the identities a real cluster hands out: service-account tokens bound to pods, the
cluster admin's client certificate, and impersonation of the break-glass group."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from lockstep import admission, keys
from lockstep.environment import SHARED_MOUNT
from lockstep.protocol import PROTOCOL
from lockstep_e2e.cluster import LocalCluster
from lockstep_e2e.fixtures import fresh_namespace, running_job, wait_for
from lockstep_e2e.install import apply, pod_client, read_pod, service_account_token, token_client
from lockstep_e2e.jobs import announce_weights, create_job, get_job, phase, rljob
from lockstep_e2e.podrunner import run_pod
from lockstep_workers.weights.files import newest_version, publish, weights_directory

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("lockstep")]

RBAC = "rbac.authorization.k8s.io"
OWN_KEYS = ", ".join(admission.POD_KEYS)
MANAGED_BY_SETTERS = (
    f"the Lockstep operator ({keys.OPERATOR_USERNAME}) sets or removes it (and the StatefulSet controller creates the "
    f"pods of an actor group with it), or a member of group {keys.BREAK_GLASS_GROUP}"
)


def refused(call: Callable[[], Any], policy: str = admission.BARRIER_POLICY) -> str:
    """Run ``call``, which ``policy`` must refuse with 403 Forbidden; the rule it names."""
    with pytest.raises(ApiException) as error:
        call()
    status = json.loads(error.value.body)
    assert (error.value.status, status["reason"]) == (403, "Forbidden"), error.value.body
    prefix = f"ValidatingAdmissionPolicy '{policy}' with binding '{policy}' "
    assert prefix + "denied request: " in status["message"], status["message"]
    message: str = status["message"]
    return message[message.index("denied request: ") + len("denied request: ") :]


def annotate(core: client.CoreV1Api, namespace: str, pod: str, values: dict[str, str | None]) -> Callable[[], Any]:
    """A call that sets (or, for ``None``, removes) annotations on a pod, as ``kubectl annotate`` does."""
    return lambda: core.patch_namespaced_pod(pod, namespace, {"metadata": {"annotations": values}})


def pod_rbac(
    namespace: str, subject: dict[str, str], verbs: list[str], resource: str = "pods", api_group: str = ""
) -> list[dict[str, Any]]:
    """A Role granting ``verbs`` on ``resource`` of ``api_group`` (pods, or a subresource such as pods/status, of
    the core group; or another kind's) in ``namespace`` to ``subject``, and its binding."""
    name = f"e2e-{subject['name']}-{resource.replace('/', '-')}"
    return [
        {
            "apiVersion": f"{RBAC}/v1",
            "kind": "Role",
            "metadata": {"name": name, "namespace": namespace},
            "rules": [{"apiGroups": [api_group], "resources": [resource], "verbs": verbs}],
        },
        {
            "apiVersion": f"{RBAC}/v1",
            "kind": "RoleBinding",
            "metadata": {"name": name, "namespace": namespace},
            "roleRef": {"apiGroup": RBAC, "kind": "Role", "name": name},
            "subjects": [subject],
        },
    ]


def annotations(api: client.ApiClient, namespace: str, pod: str) -> dict[str, str]:
    found: dict[str, str] = read_pod(api, namespace, pod)["metadata"].get("annotations") or {}
    return found


def bare_pod(name: str, service_account: str = "default", labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {"serviceAccountName": service_account, "containers": [{"name": "main", "image": "busybox"}]},
    }


def test_a_pod_token_may_change_only_its_own_annotations_on_itself(kube: client.ApiClient, namespace: str) -> None:
    """Issue item 7: the worker Role lets a pod patch every pod of its job; admission narrows that to its own
    four annotations on itself."""
    actor = running_job(kube, namespace, "fj1", 1)[0]
    trainer = "fj1-trainer-0"
    as_actor = client.CoreV1Api(pod_client(kube, namespace, actor))
    worker = f"system:serviceaccount:{namespace}:fj1-worker"
    body = read_pod(kube, namespace, trainer)
    container, image = body["spec"]["containers"][0]["name"], body["spec"]["containers"][0]["image"]

    def patch(pod: str, patch: dict[str, Any]) -> Callable[[], Any]:
        return lambda: as_actor.patch_namespaced_pod(pod, namespace, patch)

    evil = {"spec": {"containers": [{"name": container, "image": "attacker/evil:latest"}]}}
    uid = read_pod(kube, namespace, actor)["metadata"]["uid"]
    for attack in (evil, {"spec": {"activeDeadlineSeconds": 1}}, {"metadata": {"labels": {"touched": "yes"}}}):
        assert refused(patch(trainer, attack)) == (
            "a service-account token bound to a pod may only update that pod itself, not UPDATE pod "
            f"{namespace}/{trainer}: {worker} for pod {actor} (uid {uid})"
        )

    def own(change: str) -> str:
        return f"pod {namespace}/{actor} may change only its own annotations ({OWN_KEYS}) with its token, not {change}"

    actor_container = read_pod(kube, namespace, actor)["spec"]["containers"][0]["name"]
    attacks = {
        "spec": {"spec": {"containers": [{"name": actor_container, "image": "attacker/evil:latest"}]}},
        f"metadata.annotations[{keys.CONFIG_FINGERPRINT}]": {
            "metadata": {"annotations": {keys.CONFIG_FINGERPRINT: "sha256:forged"}}
        },
        f"metadata.labels[{keys.MANAGED_BY}]": {"metadata": {"labels": {keys.MANAGED_BY: "someone-else"}}},
        "metadata.finalizers": {"metadata": {"finalizers": ["attacker.example/keep"]}},
    }
    for change, attack in attacks.items():
        assert refused(patch(actor, attack)) == own(change)
    # Removing the label that makes the pod Lockstep's does not take it out of the policy's reach.
    unlabel = {"metadata": {"labels": {keys.MANAGED_BY: None}, "annotations": {keys.CONFIG_FINGERPRINT: "x"}}}
    assert refused(patch(actor, unlabel)) == own(
        f"metadata.labels[{keys.MANAGED_BY}], metadata.annotations[{keys.CONFIG_FINGERPRINT}]"
    )

    ack = json.dumps({"protocol": PROTOCOL, "id": "e2e/1/1", "phase": "Paused"})
    annotate(as_actor, namespace, actor, {keys.BARRIER_ACK: ack})()  # its own key on itself: allowed
    assert read_pod(kube, namespace, trainer)["spec"]["containers"][0]["image"] == image
    assert "activeDeadlineSeconds" not in read_pod(kube, namespace, trainer)["spec"]
    assert read_pod(kube, namespace, actor)["metadata"]["labels"][keys.MANAGED_BY] == keys.MANAGER


def test_a_pod_token_may_not_create_or_delete_lockstep_pods_whatever_rbac_grants(
    kube: client.ApiClient, namespace: str
) -> None:
    """Issue item 7, CREATE and DELETE: the worker Role grants neither, and admission refuses them anyway."""
    actor = running_job(kube, namespace, "fj3", 1)[0]
    subject = {"kind": "ServiceAccount", "name": "fj3-worker", "namespace": namespace}
    apply(kube, pod_rbac(namespace, subject, ["create", "delete"]))
    as_actor = client.CoreV1Api(pod_client(kube, namespace, actor))
    rule = "a service-account token bound to a pod may only update that pod itself, not"
    token = f"system:serviceaccount:{namespace}:fj3-worker for pod {actor}"

    message = refused(lambda: as_actor.delete_namespaced_pod("fj3-trainer-0", namespace))
    assert message.startswith(f"{rule} DELETE pod {namespace}/fj3-trainer-0: {token} (uid "), message
    message = refused(lambda: as_actor.delete_namespaced_pod(actor, namespace))
    assert message.startswith(f"{rule} DELETE pod {namespace}/{actor}: {token} (uid "), message
    impostor = bare_pod("fj3-actor-9", "fj3-worker", {keys.MANAGED_BY: keys.MANAGER, keys.JOB: "fj3"})
    message = refused(lambda: as_actor.create_namespaced_pod(namespace, impostor))
    assert message.startswith(f"{rule} CREATE pod {namespace}/fj3-actor-9: {token} (uid "), message
    assert read_pod(kube, namespace, "fj3-trainer-0")["metadata"].get("deletionTimestamp") is None


def test_the_status_subresource_writes_no_barrier_key_and_no_managed_by_label(
    kube: client.ApiClient, namespace: str
) -> None:
    """Issue 21 item 1: a write through pods/status keeps the label and annotation changes it carries. A service
    account granted only get/patch/update on pods/status, as kubelets and readiness-gate controllers are, may write
    status and nothing of the barrier; a pod's own token may not write its status."""
    actor = running_job(kube, namespace, "sub", 1)[0]
    trainer = "sub-trainer-0"
    core = client.CoreV1Api(kube)
    core.create_namespaced_service_account(namespace, {"metadata": {"name": "status-writer"}})
    subject = {"kind": "ServiceAccount", "name": "status-writer", "namespace": namespace}
    apply(kube, pod_rbac(namespace, subject, ["get", "patch", "update"], "pods/status"))
    writer = client.CoreV1Api(token_client(kube, service_account_token(kube, namespace, "status-writer", seconds=600)))
    caller = f"system:serviceaccount:{namespace}:status-writer (through pods/status)"

    def status_patch(pod: str, metadata: dict[str, Any]) -> Callable[[], Any]:
        return lambda: writer.patch_namespaced_pod_status(pod, namespace, {"metadata": metadata})

    weights = json.dumps({"protocol": PROTOCOL, "version": 77, "uri": "file:///x/v77", "digest": "sha256:0"})
    command = json.dumps({"protocol": PROTOCOL, "id": "forged/77/1", "version": 77, "phase": "Update"})
    ack = json.dumps({"protocol": PROTOCOL, "id": "forged/77/1", "phase": "Updated", "loadedVersion": 77})
    assert refused(status_patch(trainer, {"annotations": {keys.WEIGHTS: weights}})) == (
        f"{keys.WEIGHTS} on pod {trainer} may be written only by that pod itself (a service-account token bound to "
        f"it), not by {caller}; a token is bound to a pod when its namespace, pod name and pod UID all match the pod"
    )
    assert refused(status_patch(actor, {"annotations": {keys.BARRIER: command}})) == (
        f"{keys.BARRIER} may be written only by the Lockstep operator ({keys.OPERATOR_USERNAME}), or by a member of "
        f"group {keys.BREAK_GLASS_GROUP}, not by {caller}"
    )
    assert refused(status_patch(actor, {"annotations": {keys.BARRIER_ACK: ack}})).startswith(
        f"{keys.BARRIER_ACK} on pod {actor} may be written only by that pod itself"
    )
    assert refused(status_patch(actor, {"labels": {keys.MANAGED_BY: None}})) == (
        f"the label {keys.MANAGED_BY}={keys.MANAGER} (on pod {namespace}/{actor}) marks a pod as managed by Lockstep: "
        f"only {MANAGED_BY_SETTERS}, not {caller}"
    )
    # What pods/status is for stays the writer's (RBAC grants it; admission has no say).
    checked = {"conditions": [{"type": "e2e.example/Checked", "status": "True"}]}
    writer.patch_namespaced_pod_status(actor, namespace, {"status": checked})

    # A pod's own token, even where RBAC grants it pods/status, changes nothing there but its own annotations.
    worker = {"kind": "ServiceAccount", "name": "sub-worker", "namespace": namespace}
    apply(kube, pod_rbac(namespace, worker, ["get", "patch"], "pods/status"))
    as_actor = client.CoreV1Api(pod_client(kube, namespace, actor))
    failed = {"status": {"phase": "Failed"}}
    assert refused(lambda: as_actor.patch_namespaced_pod_status(actor, namespace, failed)) == (
        f"pod {namespace}/{actor} may change only its own annotations ({OWN_KEYS}) with its token, not status"
    )

    for pod in (actor, trainer):
        found = annotations(kube, namespace, pod)
        assert not {keys.WEIGHTS, keys.BARRIER, keys.BARRIER_ACK} & set(found), found
    assert read_pod(kube, namespace, actor)["metadata"]["labels"][keys.MANAGED_BY] == keys.MANAGER
    assert read_pod(kube, namespace, actor)["status"]["phase"] == "Running"
    status = get_job(kube, namespace, "sub")["status"]
    assert not status.get("barrier") and status.get("weightsVersion") is None, status


def test_a_pod_binding_carries_no_barrier_key_onto_the_pod(kube: client.ApiClient, namespace: str) -> None:
    """Issue 21 item 1, pods/binding: the API server copies a Binding's annotations onto the pod it binds, so a
    binding that carries a barrier key (or the managed-by label) is refused; an ordinary binding passes."""
    core = client.CoreV1Api(kube)
    core.create_namespaced_service_account(namespace, {"metadata": {"name": "binder"}})
    subject = {"kind": "ServiceAccount", "name": "binder", "namespace": namespace}
    apply(kube, pod_rbac(namespace, subject, ["create"], "pods/binding"))
    binder = client.CoreV1Api(token_client(kube, service_account_token(kube, namespace, "binder", seconds=600)))
    for name in ("unbound-a", "unbound-b"):
        core.create_namespaced_pod(
            namespace, {**bare_pod(name), "spec": {**bare_pod(name)["spec"], "schedulerName": "e2e-none"}}
        )
    node = core.list_node().items[0].metadata.name
    command = json.dumps({"protocol": PROTOCOL, "id": "forged/5/1", "version": 5, "phase": "Update"})

    def bind(pod: str, metadata: dict[str, Any]) -> Callable[[], Any]:
        body = {"metadata": {"name": pod, **metadata}, "target": {"kind": "Node", "name": node}}
        return lambda: binder.create_namespaced_pod_binding(pod, namespace, body, _preload_content=False)

    forged = {"annotations": {keys.BARRIER: command}, "labels": {keys.MANAGED_BY: keys.MANAGER}}
    assert refused(bind("unbound-a", forged), admission.BINDING_POLICY) == (
        f"a pods/binding copies its annotations and labels onto the pod it binds ({namespace}/unbound-a): "
        f"{keys.BARRIER}, {keys.MANAGED_BY} may be set only by the Lockstep operator ({keys.OPERATOR_USERNAME}) or a "
        f"member of group {keys.BREAK_GLASS_GROUP}, not by system:serviceaccount:{namespace}:binder; bind the pod "
        "without them"
    )
    assert not read_pod(kube, namespace, "unbound-a")["spec"].get("nodeName")
    bind("unbound-b", {"annotations": {"team": "e2e"}})()
    assert read_pod(kube, namespace, "unbound-b")["spec"]["nodeName"] == node


def test_a_token_is_a_pod_own_only_with_its_namespace_name_and_uid(kube: client.ApiClient, namespace: str) -> None:
    """Issue item 8: a pod of the same name in another namespace, granted patch here by a careless RoleBinding,
    may not write the trainer's weights."""
    running_job(kube, namespace, "fj2", 1)
    trainer = "fj2-trainer-0"
    weights = json.dumps(
        {"protocol": PROTOCOL, "version": 9, "uri": "http://attacker.example/v9", "digest": "sha256:0"}
    )
    with fresh_namespace(kube, "spoofer") as other:
        core = client.CoreV1Api(kube)
        core.create_namespaced_service_account(other, {"metadata": {"name": "spoofer"}})
        spoofer = core.create_namespaced_pod(other, bare_pod(trainer, "spoofer"))
        subject = {"kind": "ServiceAccount", "name": "spoofer", "namespace": other}
        apply(kube, pod_rbac(namespace, subject, ["get", "patch"]))
        body = read_pod(kube, other, trainer)
        as_spoofer = client.CoreV1Api(
            token_client(kube, service_account_token(kube, other, "spoofer", pod=body, seconds=600))
        )
        assert refused(annotate(as_spoofer, namespace, trainer, {keys.WEIGHTS: weights})) == (
            f"{keys.WEIGHTS} on pod {trainer} may be written only by that pod itself (a service-account token bound "
            f"to it), not by system:serviceaccount:{other}:spoofer for pod {trainer} (uid {spoofer.metadata.uid}); "
            "a token is bound to a pod when its namespace, pod name and pod UID all match the pod"
        )
    assert keys.WEIGHTS not in annotations(kube, namespace, trainer)


def impersonating(
    api: client.ApiClient, user: str, group: str | None = None, extra: dict[str, str] | None = None
) -> client.ApiClient:
    """The admin's client, acting as ``user`` (in ``group``, with ``extra``, as a token bound to a pod carries):
    ``kubectl --as=user --as-group=group``."""
    impersonated = client.ApiClient(api.configuration)
    impersonated.set_default_header("Impersonate-User", user)
    if group:
        impersonated.set_default_header("Impersonate-Group", group)
    for key, value in (extra or {}).items():  # the key percent-encoded, as the API server reads it
        impersonated.set_default_header(f"Impersonate-Extra-{key.replace('/', '%2F')}", value)
    return impersonated


def test_only_the_controllers_of_a_leader_worker_set_handle_the_lockstep_pods_of_one(
    kube: client.ApiClient, namespace: str
) -> None:
    """Actor groups (docs/actor-groups.md): the StatefulSet controller creates a LeaderWorkerSet's pods with the
    managed-by label, and LeaderWorkerSet's controller, which runs in a pod of its own, deletes a group's leader to
    recreate the group. Only they, and only on pods of a LeaderWorkerSet; the same label gets a pod token nothing."""
    # A group's leader, with what LeaderWorkerSet's own pod webhook (which runs here) expects of the pods of a set.
    in_a_set = {keys.MANAGED_BY: keys.MANAGER, keys.JOB: "sets", keys.GROUP_SET_NAME: "sets-actor"}
    leader = bare_pod("sets-actor-0", labels={**in_a_set, "leaderworkerset.sigs.k8s.io/worker-index": "0"})
    leader["metadata"]["annotations"] = {"leaderworkerset.sigs.k8s.io/size": "2"}
    statefulsets = client.CoreV1Api(impersonating(kube, keys.STATEFULSET_CONTROLLER_USERNAME))
    outside = bare_pod("sets-trainer-0", labels={keys.MANAGED_BY: keys.MANAGER, keys.JOB: "sets"})
    assert refused(lambda: statefulsets.create_namespaced_pod(namespace, outside)).startswith(
        f"the label {keys.MANAGED_BY}={keys.MANAGER} (on pod {namespace}/sets-trainer-0) marks a pod as managed by "
        f"Lockstep: only {MANAGED_BY_SETTERS}, not {keys.STATEFULSET_CONTROLLER_USERNAME}"
    )
    assert refused(lambda: statefulsets.create_namespaced_pod(namespace, leader)).startswith(
        f"the label {keys.MANAGED_BY}={keys.MANAGER} (on pod {namespace}/sets-actor-0)"
    ), "issue 46: the StatefulSet controller creates only the pods of a StatefulSet that controls them"
    # Its StatefulSet (replicas 0, a selector of its own: the controller leaves the pod be, or only releases it).
    owner = {"app": "sets-owner"}
    stateful_set = client.AppsV1Api(kube).create_namespaced_stateful_set(
        namespace,
        {
            "metadata": {"name": "sets-actor"},
            "spec": {
                "replicas": 0,
                "serviceName": "sets-actor",
                "selector": {"matchLabels": owner},
                "template": {"metadata": {"labels": owner}, "spec": bare_pod("x")["spec"]},
            },
        },
    )
    leader["metadata"]["ownerReferences"] = [
        {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "name": "sets-actor",
            "uid": stateful_set.metadata.uid,
            "controller": True,
        }
    ]
    statefulsets.create_namespaced_pod(namespace, leader)
    unlabel = {"metadata": {"labels": {keys.MANAGED_BY: None}}}
    assert refused(lambda: statefulsets.patch_namespaced_pod("sets-actor-0", namespace, unlabel)).startswith(
        f"the label {keys.MANAGED_BY}={keys.MANAGER} (on pod {namespace}/sets-actor-0)"
    ), "only at creation"

    # A token bound to a pod, as LeaderWorkerSet's controller holds one in its own pod; RBAC lets it delete pods.
    bound = {keys.POD_NAME_EXTRA: "lws-controller-manager-0", keys.POD_UID_EXTRA: "uid-of-its-pod"}
    intruder = f"system:serviceaccount:{namespace}:intruder"
    for user in (keys.LWS_CONTROLLER_USERNAME, intruder):
        account_namespace, name = user.split(":")[2:]
        subject = {"kind": "ServiceAccount", "name": name, "namespace": account_namespace}
        apply(kube, pod_rbac(namespace, subject, ["delete"]))
    as_intruder = client.CoreV1Api(impersonating(kube, intruder, extra=bound))
    assert "a service-account token bound to a pod may only update that pod itself, not DELETE pod" in refused(
        lambda: as_intruder.delete_namespaced_pod("sets-actor-0", namespace)
    )
    as_lws = client.CoreV1Api(impersonating(kube, keys.LWS_CONTROLLER_USERNAME, extra=bound))
    as_lws.delete_namespaced_pod("sets-actor-0", namespace)


def test_the_policy_covers_only_lockstep_pods_and_break_glass_repairs_them(
    kube: client.ApiClient, namespace: str
) -> None:
    """Issue item 10: scoped to pods labelled as Lockstep's (before or after the request), a clear refusal for
    an identity without ``extra``, and a break-glass group that may repair a pod by hand."""
    admin = client.CoreV1Api(kube)
    command = json.dumps({"protocol": PROTOCOL, "id": "hand/1/1", "phase": "Pause"})
    with fresh_namespace(kube, "bystander") as other:
        # Not Lockstep's pod: the policy is not involved, whatever the annotations.
        admin.create_namespaced_pod(other, bare_pod("bystander"))
        annotate(admin, other, "bystander", {keys.BARRIER: command})()
        # ... until the pod is made Lockstep's, which only the operator may do.
        label = {"metadata": {"labels": {keys.MANAGED_BY: keys.MANAGER}}}
        assert refused(lambda: admin.patch_namespaced_pod("bystander", other, label)) == (
            f"the label {keys.MANAGED_BY}={keys.MANAGER} (on pod {other}/bystander) marks a pod as managed by "
            f"Lockstep: only {MANAGED_BY_SETTERS}, not lockstep-admin"
        )

    actor = running_job(kube, namespace, "glass", 1)[0]
    announce_weights(kube, namespace, "glass", 1)
    # The operator writes the commands, then the status that records the barrier: wait for both.
    wait_for(lambda: keys.BARRIER in annotations(kube, namespace, actor), "the Update command")
    wait_for(
        lambda: (get_job(kube, namespace, "glass")["status"].get("barrier") or {}).get("phase") == "Update",
        "the barrier in the job's status",
    )
    # The admin (a client certificate: no userInfo.extra) gets the rule, not a CEL error.
    assert refused(annotate(admin, namespace, actor, {keys.BARRIER: None})).startswith(
        f"{keys.BARRIER} may be written only by the Lockstep operator ({keys.OPERATOR_USERNAME}), or by a member of "
        f"group {keys.BREAK_GLASS_GROUP}, not by lockstep-admin"
    )
    ack = json.dumps({"protocol": PROTOCOL, "id": "hand/1/1", "phase": "Paused"})
    assert refused(annotate(admin, namespace, actor, {keys.BARRIER_ACK: ack})) == (
        f"{keys.BARRIER_ACK} on pod {actor} may be written only by that pod itself (a service-account token bound "
        "to it), not by lockstep-admin; a token is bound to a pod when its namespace, pod name and pod UID all match "
        "the pod"
    )
    unlabel = {"metadata": {"labels": {keys.MANAGED_BY: None}}}
    assert refused(lambda: admin.patch_namespaced_pod(actor, namespace, unlabel)).startswith(
        f"the label {keys.MANAGED_BY}={keys.MANAGER} (on pod {namespace}/{actor}) marks a pod as managed by Lockstep"
    )
    # Everything else on the pod is RBAC's business.
    admin.patch_namespaced_pod(actor, namespace, {"metadata": {"labels": {"team": "e2e"}}})

    # Break glass: whoever may act in the group may repair the pod by hand.
    group = {"kind": "Group", "name": keys.BREAK_GLASS_GROUP, "apiGroup": RBAC}
    apply(kube, pod_rbac(namespace, group, ["get", "patch"]))
    repair = client.CoreV1Api(impersonating(kube, "alice", keys.BREAK_GLASS_GROUP))
    annotate(repair, namespace, actor, {keys.BARRIER: None, keys.BARRIER_ACK: ack})()
    assert annotations(kube, namespace, actor).get(keys.BARRIER_ACK) == ack
    # Without the group, the same user is refused like anyone else.
    alice = client.CoreV1Api(impersonating(kube, "alice"))
    apply(kube, pod_rbac(namespace, {"kind": "User", "name": "alice", "apiGroup": RBAC}, ["get", "patch"]))
    assert "not by alice" in refused(annotate(alice, namespace, actor, {keys.BARRIER_ACK: None}))


def test_the_trainers_identity_finds_the_actors_in_their_endpoint_slices_and_no_further(
    kube: client.ApiClient, namespace: str
) -> None:
    """What the trainer's rollout client watches, read with its own pod-bound token: every actor pod's address on
    the actor port, ready as the pod is; EndpointSlices of other namespaces stay closed to it."""
    from lockstep.desired import actor_service_name
    from lockstep.environment import ACTOR_PORT
    from lockstep_workers.rollout.client import EndpointSlices

    actors = running_job(kube, namespace, "finder", 2)
    trainer = pod_client(kube, namespace, "finder-trainer-0")
    core = client.CoreV1Api(kube)
    addresses = {f"http://{core.read_namespaced_pod(pod, namespace).status.pod_ip}:{ACTOR_PORT}" for pod in actors}
    found = EndpointSlices(namespace, actor_service_name("finder"), trainer)
    try:
        wait_for(lambda: dict(found.endpoints()) == dict.fromkeys(addresses, True), f"the actors at {addresses}")
    finally:
        found.stop()
    with pytest.raises(ApiException) as forbidden:
        client.DiscoveryV1Api(trainer).list_namespaced_endpoint_slice("default")
    assert forbidden.value.status == 403


PROBE = """
import json, os, sys
root, own, other = sys.argv[1:]
seen = {"listed": sorted(os.listdir(root))}
for name, path in (("plant", f"{root}/{other}/weights/v999999.safetensors"), ("write", f"{root}/{own}/mine")):
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        open(path, "wb").close()
        seen[name] = "written"
    except OSError as error:
        seen[name] = type(error).__name__
print("PROBE " + json.dumps(seen))
"""
"""Run in a pod's place, with its mounts: what of the shared volume it sees, and whether it can write into another
job's directory (``plant``) and its own (``write``)."""


def test_a_jobs_pods_see_and_write_only_their_own_directory_of_a_shared_volume(
    cluster: LocalCluster, kube: client.ApiClient, namespace: str, tmp_path: Path
) -> None:
    """Issue 21 item 3: two jobs on one hostPath. Each pod mounts its job's directory alone (subPath); the
    trainer writes there, the actors only read; a file another job's trainer tries to plant never reaches the
    directory this job's trainer resumes from."""
    shared = tmp_path / "shared"
    volume = {"hostPath": {"path": str(shared), "type": "DirectoryOrCreate"}}
    for name in ("victim", "intruder"):
        create_job(kube, namespace, rljob(name, actors=1, weightSync={"volume": volume}))
    for name in ("victim", "intruder"):
        wait_for(lambda name=name: phase(get_job(kube, namespace, name)) == "Running", f"RLJob {name} to run")
    victim, intruder = (get_job(kube, namespace, name)["metadata"]["uid"] for name in ("victim", "intruder"))
    publish({"w": torch.zeros(2)}, weights_directory(shared / victim), version=1)

    def probe(pod: str) -> dict[str, str]:
        log = tmp_path / f"{pod}.log"
        argv = [sys.executable, "-c", PROBE, SHARED_MOUNT, intruder, victim]
        component = run_pod(cluster, kube, namespace, pod, log, command=argv)
        assert component.process is not None and component.process.wait(timeout=60) == 0, log.read_text()
        [line] = [line for line in log.read_text().splitlines() if line.startswith("PROBE ")]
        return dict(json.loads(line.removeprefix("PROBE ")))

    def victims_weights() -> list[str]:
        return sorted(path.name for path in weights_directory(shared / victim).iterdir())

    trainer = probe("intruder-trainer-0")
    # Its "plant" landed in its own container's filesystem, not on the volume.
    assert trainer == {"listed": [intruder], "plant": "written", "write": "written"}, trainer
    assert (shared / intruder / "mine").exists(), "the trainer writes in its job's directory"
    assert victims_weights() == ["v000001.safetensors"], "nothing reached the directory the victim resumes from"
    assert newest_version(weights_directory(shared / victim)) == 1
    actor = probe("intruder-actor-0")
    assert actor["listed"] == [intruder] and actor["write"] == "OSError", f"read-only: {actor}"
    assert victims_weights() == ["v000001.safetensors"]
