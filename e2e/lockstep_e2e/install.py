"""Install Lockstep's manifests into a cluster and run the operator as a local process."""

from __future__ import annotations

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
from lockstep_e2e.cluster import ClusterError, Component, free_port

REPO = Path(__file__).resolve().parents[2]
CRD_DIR = REPO / "crds"
FIELD_MANAGER = "lockstep-e2e"


def manifests(directory: Path = CRD_DIR) -> list[dict[str, Any]]:
    """Every document in ``directory``'s YAML files, CustomResourceDefinitions first."""
    documents = [
        document
        for path in sorted(directory.glob("*.yaml"))
        for document in yaml.safe_load_all(path.read_text())
        if document
    ]
    return sorted(documents, key=lambda d: d["kind"] != "CustomResourceDefinition")


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


def start_operator(kubeconfig: Path, log_path: Path, *args: str, timeout: float = 60.0) -> Component:
    """Run ``python -m lockstep.controller`` against the cluster; return once its liveness probe answers."""
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
