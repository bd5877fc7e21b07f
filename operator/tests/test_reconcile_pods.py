"""The pods step (lockstep.reconcile.pods): the job's pods and children against what its spec asks for."""

from __future__ import annotations

from typing import Any

from factories import NOW, REWARD, job, policy, running
from lockstep import keys, tracing
from lockstep.api import Phase
from lockstep.conditions import PARITY_LOCKED, READY, find
from lockstep.reconcile import Observed, reconcile
from reconcile_helpers import condition, pass_after, plan_for, settle, status_of


def test_new_job_creates_its_pods_and_children() -> None:
    plan = plan_for(job())
    assert [p["metadata"]["name"] for p in plan.create_pods] == ["demo-actor-0", "demo-actor-1", "demo-trainer-0"]
    kinds = {"ServiceAccount", "Role", "RoleBinding", "ConfigMap", "Service", "NetworkPolicy"}
    assert {c["kind"] for c in plan.children} == kinds
    role = next(c for c in plan.children if c["kind"] == "Role")
    assert role["rules"][0]["resourceNames"] == ["demo-actor-0", "demo-actor-1", "demo-trainer-0"]
    assert role["rules"][1] == {
        "apiGroups": ["discovery.k8s.io"],
        "resources": ["endpointslices"],
        "verbs": ["list", "watch"],
    }, "the trainer finds the actors in their Service's EndpointSlices, and may do nothing else with them"
    trainer = {e["name"]: e.get("value") for e in plan.create_pods[-1]["spec"]["containers"][0]["env"]}
    assert trainer["LOCKSTEP_ACTORS_SERVICE"] == "demo-actors" and "LOCKSTEP_ACTORS_URL" not in trainer
    assert {p["spec"]["serviceAccountName"] for p in plan.create_pods} == {"demo-worker"}
    assert plan.status.phase is Phase.PENDING
    assert condition(plan, PARITY_LOCKED) == ("True", "Locked")
    assert plan.status.config_fingerprint and plan.status.parity_policy == "default"


def test_job_is_running_once_every_pod_is_ready() -> None:
    body, pods = settle(job())
    assert body["status"]["phase"] == "Running"
    assert body["status"]["actors"] == {"desired": 2, "ready": 2, "summary": "2/2"}
    plan = plan_for(body, pods)
    assert not plan.create_pods and not plan.delete_pods
    assert status_of(plan) == body["status"], "a settled job must not rewrite its status"


def test_trainer_pods_get_the_torch_distributed_environment() -> None:
    plan = plan_for(job(trainer={"image": "t", "reward": REWARD, "replicas": 2}))
    trainers = [p for p in plan.create_pods if p["metadata"]["labels"][keys.ROLE] == keys.TRAINER]
    env = [{e["name"]: e.get("value") for e in p["spec"]["containers"][0]["env"]} for p in trainers]
    assert [e["RANK"] for e in env] == ["0", "1"]
    assert {e["WORLD_SIZE"] for e in env} == {"2"}
    assert {e["MASTER_ADDR"] for e in env} == {"demo-trainer-0.demo-trainer.team-a.svc"}
    assert trainers[1]["spec"]["subdomain"] == "demo-trainer"


def test_the_operators_otlp_endpoint_reaches_the_trainers_and_a_jobs_own_replaces_it() -> None:
    operator_env = tracing.forwarded({tracing.ENDPOINT: "http://collector:4318", tracing.SERVICE: "lockstep-operator"})
    assert operator_env == {tracing.ENDPOINT: "http://collector:4318"}, "the trainers name their own service"

    def environments(body: dict[str, Any]) -> dict[str, dict[str, str | None]]:
        plan = reconcile(Observed(body, [], [policy()], {}, NOW, trainer_env=operator_env))
        return {
            p["metadata"]["labels"][keys.ROLE]: {e["name"]: e.get("value") for e in p["spec"]["containers"][0]["env"]}
            for p in plan.create_pods
        }

    default = environments(job())
    assert default[keys.TRAINER][tracing.ENDPOINT] == "http://collector:4318"
    assert tracing.ENDPOINT not in default[keys.ACTOR]
    own = [{"name": tracing.ENDPOINT, "value": "http://mine:4318"}]
    mine = environments(job(trainer={"image": "t", "reward": REWARD, "env": own}))
    assert mine[keys.TRAINER][tracing.ENDPOINT] == "http://mine:4318"


def test_a_pod_with_another_fingerprint_is_drift_and_replaced() -> None:
    body, pods = settle(job())
    pods[0]["metadata"]["annotations"][keys.CONFIG_FINGERPRINT] = "sha256:other"
    plan = plan_for(body, pods)
    assert list(plan.delete_pods) == ["demo-actor-0"]
    assert condition(plan, PARITY_LOCKED) == ("False", "Drift")


def test_scaling_actors_up_and_down() -> None:
    body, pods = settle(job())
    up = plan_for({**body, "spec": {**body["spec"], "actors": {"image": "lockstep/actor:dev", "replicas": 3}}}, pods)
    assert [p["metadata"]["name"] for p in up.create_pods] == ["demo-actor-2"]
    assert up.status.restarts == 0, "a scale-up is not a restart"
    down = plan_for({**body, "spec": {**body["spec"], "actors": {"image": "lockstep/actor:dev", "replicas": 1}}}, pods)
    assert list(down.delete_pods) == ["demo-actor-1"]


def test_replacements_the_user_asked_for_never_count_as_restarts() -> None:
    body, pods = settle(job(maxRestarts=1))
    for edit in range(4):
        edited = {**body, "spec": {**body["spec"], "actors": {"image": f"actor:v{edit}", "replicas": 2}}}
        replacing = plan_for(edited, pods)
        assert set(replacing.delete_pods) == {"demo-actor-0", "demo-actor-1"}
        assert replacing.status.replacing == ["demo-actor-0", "demo-actor-1"]
        recreated, body = pass_after(replacing, edited, pods)
        assert recreated.status.restarts == 0 and recreated.status.phase is not Phase.FAILED
        assert [p["metadata"]["name"] for p in recreated.create_pods] == ["demo-actor-0", "demo-actor-1"]
        pods = [running(p) for p in recreated.create_pods] + [p for p in pods if "trainer" in p["metadata"]["name"]]
        settled = plan_for({**body, "status": status_of(recreated)}, pods)
        assert settled.status.replacing == [] and settled.status.replacements == 2 * (edit + 1)
        body = {**body, "status": status_of(settled)}
    lost = plan_for(body, pods[1:])
    assert lost.status.restarts == 1, "a pod that vanished on its own is still a failure"


def test_a_trainer_rank_is_replaced_with_its_group() -> None:
    body, pods = settle(job(trainer={"image": "t", "reward": REWARD, "replicas": 2}))
    pods[3] = {**pods[3], "metadata": {**pods[3]["metadata"], "annotations": {keys.CONFIG_FINGERPRINT: "sha256:old"}}}
    drifted = plan_for(body, pods)
    assert set(drifted.delete_pods) == {"demo-trainer-0", "demo-trainer-1"}
    assert drifted.status.replacements == 2 and drifted.status.restarts == 0
    after, _ = pass_after(drifted, body, pods)
    assert after.status.restarts == 0 and len(after.create_pods) == 2


def test_what_the_api_server_refused_is_a_condition_and_nothing_more_is_created() -> None:
    refused = {"Pod demo-actor-0": 'Pod "demo-actor-0" is invalid: spec.containers[0].resources.limits: lots'}
    plan = reconcile(Observed(job(), [], [policy()], {}, NOW, rejected=refused))
    assert not plan.create_pods and not plan.children
    assert condition(plan, READY) == ("False", "ChildRejected")
    assert condition(plan, "Stalled") == ("True", "ChildRejected")
    message = find(plan.status.conditions, READY).message  # type: ignore[union-attr]
    assert "Pod demo-actor-0" in message and "lots" in message and "fix the RLJob's spec" in message
    assert any(e.reason == "ChildRejected" and e.type == "Warning" for e in plan.events)


def test_a_pod_name_held_by_a_pod_not_of_the_job_is_named_with_its_owner_and_what_to_do() -> None:
    """Issue 21 item 6: the shell found the name taken on create (409) by a pod not labelled as the job's."""
    squatter = {"name": "demo-trainer-0", "labels": {"app": "mine"}, "managedFields": [{"manager": "kubectl-create"}]}
    body, pods = settle(job())
    plan = reconcile(Observed(body, pods[:2], [policy()], {}, NOW, taken={"demo-trainer-0": squatter}))
    assert not plan.create_pods, "the job needs all its pods: nothing more is created"
    assert condition(plan, READY) == ("False", "PodNameTaken") and condition(plan, "Stalled") == (
        "True",
        "PodNameTaken",
    )
    message = find(plan.status.conditions, READY).message  # type: ignore[union-attr]
    assert "pod demo-trainer-0 exists and is not Lockstep's" in message
    assert "owned by nobody, written by kubectl-create" in message
    assert "kubectl delete -n team-a pod demo-trainer-0" in message and "under another name" in message
    assert [e.type for e in plan.events if e.reason == "PodNameTaken"] == ["Warning"]

    relabelled = {"name": "demo-actor-1", "labels": {}, "ownerReferences": [{"kind": "RLJob", "uid": "uid-1"}]}
    plan = reconcile(Observed(body, [pods[0], pods[2]], [policy()], {}, NOW, taken={"demo-actor-1": relabelled}))
    message = find(plan.status.conditions, READY).message  # type: ignore[union-attr]
    assert "pod demo-actor-1 is this RLJob's own pod, but its labels no longer mark it as the job's" in message
    owned = {**squatter, "ownerReferences": [{"kind": "ReplicaSet", "name": "web-1", "uid": "u"}]}
    plan = reconcile(Observed(body, pods[:2], [policy()], {}, NOW, taken={"demo-trainer-0": owned}))
    assert "owned by ReplicaSet web-1" in find(plan.status.conditions, READY).message  # type: ignore[union-attr]


QUOTA_MESSAGE = (
    'pods "demo-actor-1" is forbidden: exceeded quota: team-pods, requested: count/pods=1, used: count/pods=2, '
    "limited: count/pods=2"
)


def test_a_resource_quota_that_refuses_some_pods_makes_the_job_release_all_of_them() -> None:
    body, pods = settle(job())
    got = [p for p in pods if p["metadata"]["name"] != "demo-actor-1"]
    refused = {"Pod demo-actor-1": QUOTA_MESSAGE}
    plan = reconcile(Observed(body, got, [policy()], {}, NOW, rejected=refused))
    assert set(plan.delete_pods) == {p["metadata"]["name"] for p in got}, "a job runs all its pods or none"
    assert not plan.create_pods
    assert condition(plan, READY) == ("False", "QuotaExceeded")
    assert condition(plan, "Stalled") == ("False", "NotStalled"), "it waits for quota, like a queued job"
    message = find(plan.status.conditions, READY).message  # type: ignore[union-attr]
    assert "ResourceQuota team-pods in namespace team-a" in message and "Kueue" in message
    assert plan.status.phase is Phase.PENDING and plan.status.actors.ready == 0
    assert any(e.reason == "QuotaExceeded" and e.type == "Warning" for e in plan.events)
    other = {"Pod demo-actor-1": 'Pod "demo-actor-1" is invalid: spec.containers[0].image: Required value'}
    kept = reconcile(Observed(body, got, [policy()], {}, NOW, rejected=other))
    assert not kept.delete_pods, "another refusal keeps the pods that run"


def test_the_job_is_isolated_by_a_network_policy_unless_turned_off() -> None:
    scraper = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    plan = plan_for(job(networkPolicy={"metricsFrom": [scraper]}))
    [isolation] = [c for c in plan.children if c["kind"] == "NetworkPolicy"]
    own = {"matchLabels": {keys.MANAGED_BY: keys.MANAGER, keys.JOB: "demo", "app.kubernetes.io/instance": "demo"}}
    assert isolation["spec"]["podSelector"] == own and isolation["spec"]["policyTypes"] == ["Ingress"]
    assert isolation["spec"]["ingress"][0] == {"from": [{"podSelector": own}]}, "every port, from the job's pods"
    assert isolation["spec"]["ingress"][1]["from"] == [scraper]
    assert {p["port"] for p in isolation["spec"]["ingress"][1]["ports"]} == {8000, 9400}
    for pod in plan.create_pods:
        assert all(pod["metadata"]["labels"][k] == v for k, v in own["matchLabels"].items())
    off = plan_for(job(networkPolicy={"enabled": False}))
    assert "NetworkPolicy" not in {c["kind"] for c in off.children}
    assert off.remove_children == [("NetworkPolicy", "demo-isolation")]


def test_a_pod_that_requests_gpus_gets_its_local_rank_shared_memory_and_nccl_settings() -> None:
    trainer = {
        "image": "t",
        "reward": REWARD,
        "replicas": 2,
        "resources": {"limits": {"nvidia.com/gpu": 1}},
        "env": [{"name": "NCCL_SOCKET_IFNAME", "value": "eth0"}],
    }
    pods = {p["metadata"]["name"]: p for p in plan_for(job(trainer=trainer)).create_pods}
    for rank in (0, 1):
        pod = pods[f"demo-trainer-{rank}"]
        [container] = pod["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["LOCAL_RANK"] == "0" and env["RANK"] == str(rank)
        assert env["NCCL_SOCKET_IFNAME"] == "eth0"
        assert {"name": "lockstep-shm", "mountPath": "/dev/shm"} in container["volumeMounts"]
        assert {"name": "lockstep-shm", "emptyDir": {"medium": "Memory"}} in pod["spec"]["volumes"]
    [actor] = pods["demo-actor-0"]["spec"]["containers"]
    assert "LOCAL_RANK" not in {e["name"] for e in actor["env"]}, "the actors request no GPU here"
    assert all(m["mountPath"] != "/dev/shm" for m in actor["volumeMounts"])


def test_every_pod_runs_as_the_worker_user_on_a_read_only_root_with_writable_scratch_dirs() -> None:
    """Pod Security "restricted" (e2e: test_pod_security); a role's own HOME and its own mount at /tmp replace the
    operator's defaults, never giving the container a name or a mount path twice."""
    trainer = {
        "image": "t",
        "reward": REWARD,
        "env": [{"name": "HOME", "value": "/scratch"}],
        "volumes": [{"name": "scratch", "emptyDir": {"sizeLimit": "10Gi"}}],
        "volumeMounts": [{"name": "scratch", "mountPath": "/tmp"}],
    }
    pods = {p["metadata"]["name"]: p for p in plan_for(job(trainer=trainer, preflight={"enabled": True})).create_pods}
    pods |= {p["metadata"]["name"]: p for p in plan_for(job(trainer=trainer)).create_pods}
    assert set(pods) == {"demo-preflight-0", "demo-actor-0", "demo-actor-1", "demo-trainer-0"}
    for pod in pods.values():
        security = pod["spec"]["securityContext"]
        assert security["runAsNonRoot"] and security["seccompProfile"] == {"type": "RuntimeDefault"}
        assert security["runAsUser"] == security["runAsGroup"] == security["fsGroup"] == 10001
        [container] = pod["spec"]["containers"]
        assert container["securityContext"] == {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        }
        names = [e["name"] for e in container["env"]]
        paths = [m["mountPath"] for m in container["volumeMounts"]]
        assert len(names) == len(set(names)) and len(paths) == len(set(paths))
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        mounted = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
        env = {e["name"]: e.get("value") for e in container["env"]}
        if pod["metadata"]["labels"][keys.ROLE] == keys.TRAINER:
            assert env["HOME"] == "/scratch" and mounted["/tmp"]["name"] == "scratch"
        else:
            assert env["HOME"] == "/home/lockstep" and mounted["/tmp"] == {"name": "lockstep-tmp", "emptyDir": {}}
        assert mounted["/home/lockstep"] == {"name": "lockstep-home", "emptyDir": {}}


def test_each_pod_mounts_only_its_jobs_directory_of_the_shared_volume_and_only_the_trainer_writes() -> None:
    for spec in ({}, {"weightSync": {"backend": "gloo"}}, {"preflight": {"enabled": True}}):
        for pod in plan_for(job(**spec)).create_pods:
            [container] = pod["spec"]["containers"]
            mounts = [m for m in container["volumeMounts"] if m["name"] == "lockstep-shared"]
            role = pod["metadata"]["labels"][keys.ROLE]
            if not mounts:  # a collective job's actors take weights from the trainer, never from a volume
                assert spec and role == keys.ACTOR
                continue
            [shared] = mounts
            assert shared == {
                "name": "lockstep-shared",
                "mountPath": "/var/lib/lockstep/uid-1",
                "subPath": "uid-1",
                "readOnly": role != keys.TRAINER,
            }, pod["metadata"]["name"]
            env = {e["name"]: e.get("value") for e in container["env"]}
            assert env["LOCKSTEP_SHARED_DIR"] == shared["mountPath"]
