"""LeaderWorkerSet's real controller manager on a local control plane: built from sigs.k8s.io/lws
(lockstep_e2e.build), its CRDs and webhook configurations taken from the module's config/, its webhooks served on
loopback, as lockstep_e2e.kueue does for Kueue.

Its pod webhooks matter here: they give each pod of a group its labels and its ``LWS_*`` environment (the leader's
address, the worker's index), which the actor and the headless workers read (lockstep_workers.actor.group). As in the
module's kustomization, they see only pods labelled ``leaderworkerset.sigs.k8s.io/name``. The CRD serves one version,
so the conversion webhook that the module's kustomization adds is left out.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client

from lockstep import keys
from lockstep_e2e import build
from lockstep_e2e.cluster import ClusterError, Component, LocalCluster, free_port, port_open
from lockstep_e2e.install import apply, documents, service_account_token
from lockstep_e2e.pki import webhook_certificates

NAMESPACE = "lws-system"
"""Where the controller looks for its Secret and its leader-election lease outside a pod (pkg/utils)."""
SERVICE = "lws-webhook-service"
SECRET = "lws-webhook-server-cert"
ACCOUNT = "lws-controller-manager"
"""The service account it runs as, as in a real install: the identity the chart's leaderWorkerSet.controllerUsername
names (keys.LWS_CONTROLLER_USERNAME), which Lockstep's admission policies let make a group's StatefulSets."""
CA_NAME = "lws-ca"
"""The name LeaderWorkerSet's certificate rotator checks its CA for (pkg/cert)."""


def _identity() -> list[dict[str, Any]]:
    """LeaderWorkerSet's service account, bound to cluster-admin (a stand-in for the module's own ClusterRole)."""
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": ACCOUNT, "namespace": NAMESPACE}},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": f"e2e-{ACCOUNT}"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cluster-admin"},
            "subjects": [{"kind": "ServiceAccount", "name": ACCOUNT, "namespace": NAMESPACE}],
        },
    ]


def _webhooks(module: Path, client_config: dict[str, Any]) -> list[dict[str, Any]]:
    """LeaderWorkerSet's webhook configurations, named as its rotator knows them, the pod webhooks limited to its
    pods (config/webhook's patches), each webhook called on loopback."""
    configurations = documents(module / "config/webhook/manifests.yaml")
    pods_of_a_set = {"matchExpressions": [{"key": keys.GROUP_SET_NAME, "operator": "Exists"}]}
    for configuration in configurations:
        configuration["metadata"]["name"] = f"lws-{configuration['metadata']['name']}"
        for hook in configuration["webhooks"]:
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {**client_config, "url": client_config["url"] + path}
            if any("pods" in rule["resources"] for rule in hook["rules"]):
                hook["objectSelector"] = pods_of_a_set
    return configurations


def start_lws(cluster: LocalCluster, api: client.ApiClient, workdir: Path, timeout: float = 180.0) -> Component:
    """Install LeaderWorkerSet's CRDs and webhooks into ``cluster`` and run its controller manager; return once it
    is ready."""
    binary, module = build.build_lws(), build.lws_module()
    certificates = webhook_certificates(workdir, CA_NAME, NAMESPACE, SERVICE, SECRET)
    webhook_port, health_port, metrics_port = free_port(), free_port(), free_port()
    client_config = {"url": f"https://127.0.0.1:{webhook_port}", "caBundle": certificates.ca_bundle}
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}
    crds = [crd for path in sorted((module / "config/crd/bases").glob("*.yaml")) for crd in documents(path)]
    apply(api, [namespace, certificates.secret, *crds, *_webhooks(module, client_config), *_identity()], timeout)
    configuration = {
        "apiVersion": "config.lws.x-k8s.io/v1alpha1",
        "kind": "Configuration",
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "metrics": {"bindAddress": f"127.0.0.1:{metrics_port}"},
        "webhook": {"host": "127.0.0.1", "port": webhook_port, "certDir": str(certificates.cert_dir)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": True, "webhookServiceName": SERVICE, "webhookSecretName": SECRET},
    }
    config_path = workdir / "configuration.yaml"
    config_path.write_text(yaml.safe_dump(configuration))
    controller = Component(
        "lws",
        [str(binary), f"--config={config_path}"],
        workdir / "lws.log",
        env={"KUBECONFIG": str(cluster.token_kubeconfig(ACCOUNT, service_account_token(api, NAMESPACE, ACCOUNT)))},
    )
    controller.start_until_answering(f"http://127.0.0.1:{health_port}/readyz", timeout)
    # Ready is said before the webhook server listens (2 s apart, seen here); until then every pod of a set is
    # refused, its webhooks' failurePolicy being Fail.
    deadline = time.monotonic() + timeout
    while not port_open(webhook_port):
        controller.check_alive()
        if time.monotonic() > deadline:
            controller.stop()
            raise ClusterError(f"LeaderWorkerSet's webhook server did not listen within {timeout:.0f}s")
        time.sleep(0.2)
    return controller
