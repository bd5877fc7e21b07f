"""Run a kwok pod's real container command as a local process.

kwok keeps the pod's status; this runs what the pod would run, with the pod's command, arguments
and plain environment variables, authenticated as the pod's service account with a token bound to
the pod (what the kubelet would mount), through a kubeconfig instead of the in-cluster files.
"""

from __future__ import annotations

import sys
from pathlib import Path

from kubernetes import client

from lockstep_e2e.cluster import Component, LocalCluster
from lockstep_e2e.install import read_pod, service_account_token


def run_pod(cluster: LocalCluster, api: client.ApiClient, namespace: str, pod: str, log: Path) -> Component:
    """Start the pod's first container locally; the caller stops the returned Component."""
    body = read_pod(api, namespace, pod)
    container = body["spec"]["containers"][0]
    token = service_account_token(api, namespace, body["spec"]["serviceAccountName"], pod=body, seconds=3600)
    env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    env["KUBECONFIG"] = str(cluster.token_kubeconfig(f"pod-{namespace}-{pod}", token))
    argv = [*container.get("command", []), *container.get("args", [])]
    if argv and argv[0] == "python":
        argv[0] = sys.executable  # the project's interpreter stands in for the image's
    process = Component(f"pod/{namespace}/{pod}", argv, log, env=env)
    process.start()
    return process
