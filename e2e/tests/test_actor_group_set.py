"""The LeaderWorkerSet Lockstep renders for spec.actors.group (lockstep.desired.actor_groups), run by LeaderWorkerSet's
real controller and webhooks (lockstep_e2e.lws) on a control plane of its own: the pods it creates from the templates,
the place in the group its pod webhook gives each (read by lockstep_workers.group as the pods do), and a lost worker
recreating its whole group. The operator does not apply the set yet (docs/actor-groups.md): the test applies it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from lockstep import desired, keys
from lockstep.api import RLJobSpec
from lockstep.parity import default_policy, effective_config
from lockstep_e2e.cluster import LocalCluster
from lockstep_e2e.fixtures import wait_for
from lockstep_e2e.jobs import rljob
from lockstep_e2e.lws import start_lws
from lockstep_workers.group import node_of

pytestmark = pytest.mark.cluster

NAMESPACE = "groups"
GROUP = {"pods": 2, "tensorParallelSize": 2}
JOB = desired.JobRef("big", NAMESPACE, "uid-big")


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[client.ApiClient]:
    """An admin client of a control plane with LeaderWorkerSet running, and the namespace of the test's job with the
    job's ServiceAccount."""
    workdir = tmp_path_factory.mktemp("lws")
    with LocalCluster(workdir / "cluster") as cluster:
        api = cluster.api_client()
        controller = start_lws(cluster, api, workdir / "lws")
        core = client.CoreV1Api(api)
        core.create_namespace({"metadata": {"name": NAMESPACE}})
        core.create_namespaced_service_account(NAMESPACE, {"metadata": {"name": desired.worker_account_name(JOB.name)}})
        try:
            yield api
        finally:
            controller.stop()


def grouped(replicas: int) -> RLJobSpec:
    body = rljob(JOB.name, actors=replicas)["spec"]
    body["actors"]["group"] = GROUP
    return RLJobSpec.model_validate(body)


def pods(kube: client.ApiClient) -> dict[str, Any]:
    listed = client.CoreV1Api(kube).list_namespaced_pod(NAMESPACE, label_selector=f"{keys.JOB}={JOB.name}")
    return {pod.metadata.name: pod for pod in listed.items if pod.metadata.deletion_timestamp is None}


def test_leader_worker_set_runs_the_groups_and_tells_each_pod_its_place(kube: client.ApiClient) -> None:
    """Two groups of two pods: the leaders run the actor, the workers the headless ranks, every pod with the job's
    fingerprint; lockstep_workers.group reads each pod's place from what LeaderWorkerSet's webhook set. A deleted worker
    makes LeaderWorkerSet recreate its whole group (RecreateGroupOnPodRestart) and leaves the other group alone."""
    spec = grouped(replicas=2)
    rendered = desired.actor_groups(JOB, spec, effective_config(spec, default_policy()))
    del rendered["metadata"]["ownerReferences"]  # no RLJob here: the garbage collector would delete the set
    client.CustomObjectsApi(kube).create_namespaced_custom_object(
        "leaderworkerset.x-k8s.io", "v1", NAMESPACE, "leaderworkersets", rendered
    )
    names = {"big-actor-0", "big-actor-0-1", "big-actor-1", "big-actor-1-1"}
    wait_for(lambda: set(pods(kube)) == names, f"LeaderWorkerSet to create {sorted(names)}", timeout=90)
    fingerprint = effective_config(spec, default_policy()).fingerprint
    assert spec.actors.group is not None
    for name, pod in pods(kube).items():
        [container] = pod.spec.containers
        env = {variable.name: variable.value for variable in container.env if variable.value is not None}
        node = node_of(env, spec.actors.group)
        leader = name.count("-") == 2
        assert node.rank == (0 if leader else 1), (name, env)
        assert node.leader.startswith(f"big-actor-{name.split('-')[2]}.big-actor.{NAMESPACE}"), node.leader
        assert pod.metadata.labels[keys.ROLE] == (keys.ACTOR if leader else keys.ACTOR_WORKER)
        assert container.command[-1] == ("lockstep_workers.actor" if leader else "lockstep_workers.headless")
        assert pod.metadata.annotations[keys.CONFIG_FINGERPRINT] == fingerprint

    before = {name: pod.metadata.uid for name, pod in pods(kube).items()}
    client.CoreV1Api(kube).delete_namespaced_pod("big-actor-1-1", NAMESPACE)

    def group_one_recreated() -> bool:
        now = {name: pod.metadata.uid for name, pod in pods(kube).items()}
        return set(now) == names and now["big-actor-1"] != before["big-actor-1"]

    wait_for(group_one_recreated, "group 1 recreated whole after its worker was deleted", timeout=90)
    after = {name: pod.metadata.uid for name, pod in pods(kube).items()}
    assert after["big-actor-1-1"] != before["big-actor-1-1"]
    assert (after["big-actor-0"], after["big-actor-0-1"]) == (before["big-actor-0"], before["big-actor-0-1"]), (
        "the other group keeps its pods"
    )
