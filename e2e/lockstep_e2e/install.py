"""Install Lockstep's manifests into a cluster and run the operator as a local process."""

from __future__ import annotations

import copy
import json
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client, dynamic
from kubernetes.client.exceptions import ApiException

from lockstep import api as lockstep_api
from lockstep import keys
from lockstep_e2e.cluster import ClusterError, Component, LocalCluster, free_port

REPO = Path(__file__).resolve().parents[2]
CRD_DIR = REPO / "crds"
FIELD_MANAGER = "lockstep-e2e"


def manifests(directory: Path = CRD_DIR) -> list[dict[str, Any]]:
    """Every document in ``directory``'s YAML files (``apply`` puts the CRDs first)."""
    return [
        document
        for path in sorted(directory.glob("*.yaml"))
        for document in yaml.safe_load_all(path.read_text())
        if document
    ]


def apply(api: client.ApiClient, documents: list[dict[str, Any]]) -> None:
    """Server-side apply each document (create or update). CRDs go first; the rest waits until the CRDs are
    established and their schemas are published at /openapi/v3, which a ValidatingAdmissionPolicy's CEL type
    checker reads (a policy checked before then silently gets no type checking at all)."""
    crds = [d for d in documents if d["kind"] == "CustomResourceDefinition"]
    for document in crds:
        _server_side_apply(api, document)
    if crds:
        kinds = [crd["spec"]["names"]["kind"] for crd in crds]
        _wait(lambda: all(_established(api, crd["metadata"]["name"]) for crd in crds), f"CRDs {kinds} established")
        _wait(lambda: _published(api, kinds), f"the OpenAPI v3 schemas of {kinds}")
    for document in documents:
        if document not in crds:
            _server_side_apply(api, document)


def _server_side_apply(api: client.ApiClient, document: dict[str, Any]) -> None:
    resource = dynamic.DynamicClient(api).resources.get(api_version=document["apiVersion"], kind=document["kind"])
    resource.server_side_apply(
        body=document,
        name=document["metadata"]["name"],
        namespace=document["metadata"].get("namespace"),
        field_manager=FIELD_MANAGER,
        force_conflicts=True,
    )


def _wait(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.2)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")


def _established(api: client.ApiClient, name: str) -> bool:
    crd = client.ApiextensionsV1Api(api).read_custom_resource_definition(name)
    conditions = (crd.status and crd.status.conditions) or []
    return any(c.type == "Established" and c.status == "True" for c in conditions)


def _published(api: client.ApiClient, kinds: list[str]) -> bool:
    path = f"/openapi/v3/apis/{lockstep_api.GROUP}/{lockstep_api.VERSION}"
    method, url, headers, _, _ = api.param_serialize("GET", path)
    try:
        schemas = json.loads(api.call_api(method, url, headers).read())["components"]["schemas"]
    except (ApiException, KeyError, ValueError):
        return False
    return all(any(name.endswith(f".{kind}") for name in schemas) for kind in kinds)


def install(api: client.ApiClient) -> None:
    """CRDs, admission policies and the default ParityPolicy from crds/."""
    apply(api, manifests())


def service_account_token(
    api: client.ApiClient, namespace: str, name: str, *, pod: dict[str, Any] | None = None, seconds: int = 86400
) -> str:
    """A token for the service account; bound to ``pod`` when given, as the kubelet mounts it (the API server
    then tells who calls by ``authentication.kubernetes.io/pod-name``)."""
    bound = (
        client.V1BoundObjectReference(
            kind="Pod", api_version="v1", name=pod["metadata"]["name"], uid=pod["metadata"]["uid"]
        )
        if pod is not None
        else None
    )
    request = client.AuthenticationV1TokenRequest(
        spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=seconds, bound_object_ref=bound)
    )
    response = client.CoreV1Api(api).create_namespaced_service_account_token(name, namespace, request)
    return str(response.status.token)


def raw(response: Any) -> Any:
    """The JSON body of a call made with ``_preload_content=False``."""
    return json.loads(response.data)


def read_pod(api: client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    """The pod as the API server returns it (plain JSON)."""
    pod: dict[str, Any] = raw(client.CoreV1Api(api).read_namespaced_pod(name, namespace, _preload_content=False))
    return pod


def token_client(api: client.ApiClient, token: str) -> client.ApiClient:
    """A client of the same API server that authenticates with ``token`` instead."""
    configuration = copy.copy(api.configuration)
    configuration.cert_file = configuration.key_file = None
    configuration.api_key = {"authorization": f"Bearer {token}"}
    return client.ApiClient(configuration)


def pod_client(api: client.ApiClient, namespace: str, pod: str) -> client.ApiClient:
    """A client that acts as ``pod`` does: its service account, with a token bound to that pod."""
    body = read_pod(api, namespace, pod)
    token = service_account_token(api, namespace, body["spec"]["serviceAccountName"], pod=body, seconds=3600)
    return token_client(api, token)


def operator_kubeconfig(cluster: LocalCluster, api: client.ApiClient) -> Path:
    """Credentials of the operator's service account (the only identity that may issue barrier commands).

    It is bound to cluster-admin here; the Helm chart grants the least privilege instead.
    """
    namespace, name = keys.OPERATOR_NAMESPACE, keys.OPERATOR_SERVICE_ACCOUNT
    subject = {"kind": "ServiceAccount", "name": name, "namespace": namespace}
    apply(
        api,
        [
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name, "namespace": namespace}},
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRoleBinding",
                "metadata": {"name": name},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cluster-admin"},
                "subjects": [subject],
            },
        ],
    )
    return cluster.token_kubeconfig(name, service_account_token(api, namespace, name))


def start_operator(cluster: LocalCluster, log_path: Path, *args: str, timeout: float = 60.0) -> Component:
    """Run ``python -m lockstep.controller`` as the operator's service account; return once its liveness
    probe answers."""
    kubeconfig = operator_kubeconfig(cluster, cluster.api_client())
    port = free_port()
    operator = Component(
        "lockstep-operator",
        [sys.executable, "-m", "lockstep.controller", f"--liveness=http://127.0.0.1:{port}/healthz", *args],
        log_path,
        env={"KUBECONFIG": str(kubeconfig)},
    )
    operator.start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        operator.check_alive()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2):
                return operator
        except OSError:
            time.sleep(0.2)
    operator.stop()
    raise ClusterError(f"the operator did not report healthy within {timeout:.0f}s:\n{operator.log_tail()}")
