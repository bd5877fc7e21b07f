"""Install Lockstep's manifests into a cluster and run the operator as a local process."""

from __future__ import annotations

import copy
import functools
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client, dynamic
from kubernetes.client.exceptions import ApiException

from lockstep import keys
from lockstep_e2e import build
from lockstep_e2e.cluster import ClusterError, Component, LocalCluster, free_port

REPO = Path(__file__).resolve().parents[2]
CRD_DIR = REPO / "crds"
CHART = REPO / "charts" / "lockstep"
RELEASE = "lockstep"
# The chart's templates that hold the operator's RBAC.
RBAC_TEMPLATES = ("templates/rbac.yaml", "templates/leader-election-rbac.yaml")
FIELD_MANAGER = "lockstep-e2e"
PARAMS_NOT_SYNCED = "not yet synced to use for admission"
"""The API server's 422 for an object that a ValidatingAdmissionPolicy with a paramKind checks before its
informer for that kind has listed it (it waits 1 s): transient, right after the policy is created."""


def documents(path: Path) -> list[dict[str, Any]]:
    """Every document in the YAML file ``path``."""
    return [document for document in yaml.safe_load_all(path.read_text()) if document]


def manifests(directory: Path = CRD_DIR) -> list[dict[str, Any]]:
    """Every document in ``directory``'s YAML files (``apply`` puts the CRDs first)."""
    return [document for path in sorted(directory.glob("*.yaml")) for document in documents(path)]


def apply(api: client.ApiClient, documents: list[dict[str, Any]], timeout: float = 60.0) -> None:
    """Server-side apply each document (create or update). CRDs go first; the rest waits until the CRDs are
    established and their schemas are published at /openapi/v3, which a ValidatingAdmissionPolicy's CEL type
    checker reads (a policy checked before then silently gets no type checking at all)."""
    crds = [d for d in documents if d["kind"] == "CustomResourceDefinition"]
    for document in crds:
        _server_side_apply(api, document)
    if crds:
        kinds = [crd["spec"]["names"]["kind"] for crd in crds]
        _wait(
            lambda: all(_established(api, crd["metadata"]["name"]) for crd in crds),
            f"CRDs {kinds} established",
            timeout,
        )
        _wait(lambda: all(_published(api, crd) for crd in crds), f"the OpenAPI v3 schemas of {kinds}", timeout)
    for document in documents:
        if document not in crds:
            _apply_once_admission_is_ready(api, document, timeout)


def _apply_once_admission_is_ready(api: client.ApiClient, document: dict[str, Any], timeout: float) -> None:
    """Server-side apply ``document``, again while the API server answers PARAMS_NOT_SYNCED (a loaded API server
    can take longer than its 1 s to list a policy's params), up to ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            _server_side_apply(api, document)
            return
        except dynamic.exceptions.UnprocessibleEntityError as error:
            if PARAMS_NOT_SYNCED not in str(error) or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


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


def _published(api: client.ApiClient, crd: dict[str, Any]) -> bool:
    """Whether the schema of ``crd``'s kind is published, for every version it serves."""
    kind = crd["spec"]["names"]["kind"]
    for version in (v["name"] for v in crd["spec"]["versions"] if v.get("served", True)):
        method, url, headers, _, _ = api.param_serialize("GET", f"/openapi/v3/apis/{crd['spec']['group']}/{version}")
        try:
            schemas = json.loads(api.call_api(method, url, headers).read())["components"]["schemas"]
        except (ApiException, KeyError, ValueError):
            return False
        if not any(name.endswith(f".{kind}") for name in schemas):
            return False
    return True


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


@functools.cache
def chart_rbac(*values: str) -> tuple[dict[str, Any], ...]:
    """The operator's RBAC exactly as the Helm chart grants it (with ``values``, ``key=value`` as for --set): its
    ClusterRole and the Role for the leader election Lease, with their bindings (release ``lockstep`` in
    keys.OPERATOR_NAMESPACE)."""
    return helm_template(RBAC_TEMPLATES, values)


def helm_template(templates: tuple[str, ...] = (), values: tuple[str, ...] = ()) -> tuple[dict[str, Any], ...]:
    """The chart's ``templates`` (none named: all of them) rendered as release ``lockstep`` with ``values``
    (``key=value``, as for --set)."""
    rendered = subprocess.run(
        [str(build.build_helm()), "template", RELEASE, str(CHART), "-n", keys.OPERATOR_NAMESPACE]
        + [f"--show-only={template}" for template in templates]
        + [f"--set={value}" for value in values],
        capture_output=True,
        text=True,
        check=False,
    )
    if rendered.returncode != 0:
        raise ClusterError(f"helm template could not render the chart's {', '.join(templates)}:\n{rendered.stderr}")
    return tuple(document for document in yaml.safe_load_all(rendered.stdout) if document)


def chart_operator_env(*values: str) -> dict[str, str]:
    """The environment the chart's Deployment gives the operator's container (with ``values``)."""
    rendered = helm_template(("templates/deployment.yaml",), values)
    (deployment,) = (document for document in rendered if document["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return {variable["name"]: variable["value"] for variable in container.get("env", []) if "value" in variable}


def operator_kubeconfig(
    cluster: LocalCluster, api: client.ApiClient, instance: str, chart_values: tuple[str, ...] = ()
) -> Path:
    """Credentials of the operator's service account (the only identity that may issue barrier commands),
    with exactly the RBAC the Helm chart grants it (with ``chart_values``); a fresh token in a kubeconfig of its
    own per ``instance``."""
    namespace, name = keys.OPERATOR_NAMESPACE, keys.OPERATOR_SERVICE_ACCOUNT
    apply(
        api,
        [
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name, "namespace": namespace}},
            *chart_rbac(*chart_values),
        ],
    )
    return cluster.token_kubeconfig(f"{name}-{instance}", service_account_token(api, namespace, name))


def start_operator(
    cluster: LocalCluster, log_path: Path, *args: str, timeout: float = 60.0, chart_values: tuple[str, ...] = ()
) -> Component:
    """Run ``python -m lockstep.controller`` as the operator's service account, with the RBAC and environment
    the chart gives it under ``chart_values``; return once its liveness probe answers (a standby, under
    ``--leader-election``, answers too)."""
    port = free_port()
    kubeconfig = operator_kubeconfig(cluster, cluster.api_client(), str(port), chart_values)
    operator = Component(
        "lockstep-operator",
        [sys.executable, "-m", "lockstep.controller", f"--liveness=http://127.0.0.1:{port}/healthz", *args],
        log_path,
        env={**chart_operator_env(*chart_values), "KUBECONFIG": str(kubeconfig)},
    )
    operator.start_until_answering(f"http://127.0.0.1:{port}/healthz", timeout)
    return operator
