"""The local control plane behaves like a real cluster for what the operator relies on."""

from __future__ import annotations

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from lockstep_e2e import build
from lockstep_e2e.cluster import LocalCluster
from lockstep_e2e.fixtures import wait_for

pytestmark = pytest.mark.cluster

WIDGET_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.test.lockstep.dev"},
    "spec": {
        "group": "test.lockstep.dev",
        "scope": "Namespaced",
        "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {"type": "object", "properties": {"size": {"type": "integer", "minimum": 1}}},
                            "status": {"type": "object", "properties": {"phase": {"type": "string"}}},
                        },
                    }
                },
            }
        ],
    },
}


def test_apiserver_reports_the_built_version(cluster: LocalCluster) -> None:
    assert cluster.version() == f"Kubernetes {build.KUBERNETES_VERSION}"
    info = client.VersionApi(cluster.api_client()).get_code()
    assert info.git_version == build.KUBERNETES_VERSION


def test_custom_resource_lifecycle_with_status_subresource(kube: client.ApiClient, namespace: str) -> None:
    extensions = client.ApiextensionsV1Api(kube)
    try:
        extensions.create_custom_resource_definition(WIDGET_CRD)
    except ApiException as error:
        if error.status != 409:
            raise

    def established() -> bool:
        crd = extensions.read_custom_resource_definition("widgets.test.lockstep.dev")
        return any(c.type == "Established" and c.status == "True" for c in crd.status.conditions or [])

    wait_for(established, "the Widget CRD to be established")
    custom = client.CustomObjectsApi(kube)
    args = ("test.lockstep.dev", "v1", namespace, "widgets")
    custom.create_namespaced_custom_object(
        *args, {"apiVersion": "test.lockstep.dev/v1", "kind": "Widget", "metadata": {"name": "w"}, "spec": {"size": 2}}
    )
    assert custom.get_namespaced_custom_object(*args, "w")["spec"]["size"] == 2

    custom.patch_namespaced_custom_object(*args, "w", {"spec": {"size": 3}})
    # The status subresource ignores status written through the main resource ...
    custom.patch_namespaced_custom_object(*args, "w", {"status": {"phase": "Ignored"}})
    assert "status" not in custom.get_namespaced_custom_object(*args, "w")
    # ... and takes it through /status.
    custom.patch_namespaced_custom_object_status(*args, "w", {"status": {"phase": "Ready"}})
    widget = custom.get_namespaced_custom_object(*args, "w")
    assert widget["spec"]["size"] == 3
    assert widget["status"]["phase"] == "Ready"

    with pytest.raises(ApiException) as refused:
        custom.patch_namespaced_custom_object(*args, "w", {"spec": {"size": 0}})
    assert refused.value.status == 422
    assert "spec.size" in refused.value.body


def test_pod_is_scheduled_on_a_kwok_node_and_runs(kube: client.ApiClient, namespace: str) -> None:
    core = client.CoreV1Api(kube)
    core.create_namespaced_pod(
        namespace,
        client.V1Pod(
            metadata=client.V1ObjectMeta(name="sleeper"),
            spec=client.V1PodSpec(containers=[client.V1Container(name="main", image="busybox")]),
        ),
    )

    def running() -> bool:
        pod = core.read_namespaced_pod("sleeper", namespace)
        return pod.status.phase == "Running"

    wait_for(running, "pod sleeper to be Running")
    pod = core.read_namespaced_pod("sleeper", namespace)
    assert pod.spec.node_name.startswith("kwok-node-")
    assert any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions)
    assert pod.status.pod_ip

    core.delete_namespaced_pod("sleeper", namespace)
    wait_for(lambda: not core.list_namespaced_pod(namespace).items, "the deleted pod to go away")


def test_owned_object_is_garbage_collected_with_its_owner(kube: client.ApiClient, namespace: str) -> None:
    core = client.CoreV1Api(kube)
    owner = core.create_namespaced_config_map(namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="owner")))
    core.create_namespaced_config_map(
        namespace,
        client.V1ConfigMap(
            metadata=client.V1ObjectMeta(
                name="child",
                owner_references=[
                    client.V1OwnerReference(api_version="v1", kind="ConfigMap", name="owner", uid=owner.metadata.uid)
                ],
            )
        ),
    )
    core.delete_namespaced_config_map("owner", namespace)

    def child_gone() -> bool:
        return not core.list_namespaced_config_map(namespace, field_selector="metadata.name=child").items

    wait_for(child_gone, "the garbage collector to delete the child of a deleted owner")


def test_namespace_is_deleted_to_completion(kube: client.ApiClient) -> None:
    core = client.CoreV1Api(kube)
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name="doomed")))
    core.create_namespaced_config_map("doomed", client.V1ConfigMap(metadata=client.V1ObjectMeta(name="c")))
    core.delete_namespace("doomed")

    def gone() -> bool:
        return not core.list_namespace(field_selector="metadata.name=doomed").items

    wait_for(gone, "namespace doomed to be deleted to completion", timeout=120)
