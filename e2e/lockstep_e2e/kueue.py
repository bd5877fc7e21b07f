"""Kueue's real controller manager on a local control plane: built from sigs.k8s.io/kueue (lockstep_e2e.build),
its CRDs and webhook configurations taken from the module's config/components, its webhooks served on loopback.
Only Kueue's own kinds go through its webhooks: Lockstep drives the Workload API itself, with RLJob among Kueue's
integrations.externalFrameworks.

Kueue's internal certificate management runs as in a real installation, but finds its Secret (and the files a
kubelet would mount from it) already holding a CA and a serving certificate valid for its Service's name and for
127.0.0.1, so it keeps them, and the API server calls the webhooks at https://127.0.0.1 (there is no Service
network here).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from kubernetes import client

from lockstep import kueue
from lockstep_e2e import build
from lockstep_e2e.cluster import Component, LocalCluster, free_port
from lockstep_e2e.install import apply, documents
from lockstep_e2e.pki import webhook_certificates

NAMESPACE = "kueue-system"
SERVICE = "kueue-webhook-service"
SECRET = "kueue-webhook-server-cert"
CA_NAME = "kueue-ca"
"""The name Kueue's certificate rotator checks its CA for (pkg/util/cert)."""
CONVERTED_CRDS = ("workloads", "clusterqueues", "localqueues", "cohorts", "multikueueclusters")
"""Kueue's CRDs that serve two versions through its conversion webhook (config/components/crd/patches)."""


def _crds(module: Path, client_config: dict[str, Any]) -> list[dict[str, Any]]:
    crds = [crd for path in sorted((module / "config/components/crd/bases").glob("*.yaml")) for crd in documents(path)]
    for crd in crds:
        if crd["spec"]["names"]["plural"] in CONVERTED_CRDS:
            webhook = {"clientConfig": {**client_config, "url": client_config["url"] + "/convert"}}
            crd["spec"]["conversion"] = {
                "strategy": "Webhook",
                "webhook": {**webhook, "conversionReviewVersions": ["v1"]},
            }
    return crds


def _webhooks(module: Path, client_config: dict[str, Any]) -> list[dict[str, Any]]:
    """Kueue's webhook configurations with only the webhooks for its own kinds, each called on loopback."""
    configurations = documents(module / "config/components/webhook/manifests.yaml")
    for configuration in configurations:
        configuration["metadata"]["name"] = f"kueue-{configuration['metadata']['name']}"
        own = [
            hook
            for hook in configuration["webhooks"]
            if all(group == kueue.GROUP for rule in hook["rules"] for group in rule["apiGroups"])
        ]
        for hook in own:
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {**client_config, "url": client_config["url"] + path}
        configuration["webhooks"] = own
    return configurations


def start_kueue(cluster: LocalCluster, api: client.ApiClient, workdir: Path, timeout: float = 180.0) -> Component:
    """Install Kueue's CRDs and webhooks into ``cluster`` and run its controller manager; return once it is ready."""
    binary, module = build.build_kueue(), build.kueue_module()
    certificates = webhook_certificates(workdir, CA_NAME, NAMESPACE, SERVICE, SECRET)
    webhook_port, health_port, metrics_port = free_port(), free_port(), free_port()
    client_config = {
        "url": f"https://127.0.0.1:{webhook_port}",
        "caBundle": certificates.ca_bundle,
    }
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}
    # Kueue's eleven CRDs are large (the Workload's schema alone is 19,000 lines): give them time on a busy machine.
    apply(
        api, [namespace, certificates.secret, *_crds(module, client_config), *_webhooks(module, client_config)], timeout
    )
    configuration = {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": NAMESPACE,
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "metrics": {"bindAddress": f"127.0.0.1:{metrics_port}"},
        "webhook": {"host": "127.0.0.1", "port": webhook_port, "certDir": str(certificates.cert_dir)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": True, "webhookServiceName": SERVICE, "webhookSecretName": SECRET},
        "integrations": {"frameworks": [], "externalFrameworks": [kueue.FRAMEWORK]},
    }
    config_path = workdir / "configuration.yaml"
    config_path.write_text(yaml.safe_dump(configuration))
    controller = Component(
        "kueue",
        [
            str(binary),
            f"--config={config_path}",
            "--feature-gates=VisibilityOnDemand=false",
            f"--visibility-server-port={free_port()}",
        ],
        workdir / "kueue.log",
        env={"KUBECONFIG": str(cluster.kubeconfig)},
    )
    controller.start_until_answering(f"http://127.0.0.1:{health_port}/readyz", timeout)
    return controller
