"""The barrier agent's shell in a member pod (docs/barrier-protocol.md): ``PodAgent`` watches only its own pod (a
field selector) and writes only its own ack annotation; ``initial_weights`` reads the weights the operator set on the
pod at its creation."""

from __future__ import annotations

import logging
import threading
from typing import Any

from kubernetes import client, config, watch

from lockstep import keys
from lockstep.protocol import Command, Weights, document, read_document
from lockstep_workers.agent.core import AgentCore

logger = logging.getLogger("lockstep.agent")


def pod_api() -> client.CoreV1Api:
    """The Kubernetes API as this pod's service account (in a cluster), or as $KUBECONFIG says."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.CoreV1Api()


def initial_weights(api: client.CoreV1Api, namespace: str, pod: str) -> Weights | None:
    """The weights the job had committed when the operator created this pod (None before the first update).
    Raises ValueError, saying why, when the operator's document cannot be read."""
    metadata = api.read_namespaced_pod(pod, namespace).metadata
    weights = read_document(((metadata and metadata.annotations) or {}).get(keys.INITIAL_WEIGHTS) or None, Weights)
    if isinstance(weights, str):
        raise ValueError(f"the {keys.INITIAL_WEIGHTS} annotation on pod {namespace}/{pod} {weights}")
    return weights


def command_from(annotations: dict[str, Any]) -> Command | None:
    """The command on a pod, or None when there is none or it cannot be read (logged)."""
    command = read_document(annotations.get(keys.BARRIER), Command)
    if isinstance(command, str):
        logger.error("ignoring the barrier command on this pod: it %s", command)
        return None
    return command


class PodAgent:
    """The agent's shell: watches only its own pod and writes only its own ack annotation."""

    def __init__(self, core: AgentCore, api: client.CoreV1Api, namespace: str, pod: str) -> None:
        self.core = core
        self.api = api
        self.namespace = namespace
        self.pod = pod

    def initial_weights(self) -> Weights | None:
        """The weights the job had committed when the operator created this pod."""
        return initial_weights(self.api, self.namespace, self.pod)

    def start(self) -> None:
        """Load the pod's initial weights (set by the operator) before the pod reports ready."""
        self.core.start(self.initial_weights())

    def run(self, stop: threading.Event, watch_seconds: int = 30) -> None:
        """Act on every command written on this pod until ``stop`` is set. Each event is read as plain JSON (a
        barrier waits on every agent's watch: building the client's typed pod costs milliseconds per event)."""
        while not stop.is_set():
            stream = watch.Watch()
            for event in stream.stream(
                self.api.list_namespaced_pod,
                self.namespace,
                field_selector=f"metadata.name={self.pod}",
                timeout_seconds=watch_seconds,
                deserialize=False,
            ):
                if stop.is_set():
                    stream.stop()
                    break
                self.on_pod(event["object"]["metadata"].get("annotations") or {})

    def on_pod(self, annotations: dict[str, str]) -> None:
        command = command_from(annotations)
        if command is None:
            return
        text = document(self.core.handle(command))
        if annotations.get(keys.BARRIER_ACK) != text:
            response: Any = self.api.patch_namespaced_pod(
                self.pod,
                self.namespace,
                {"metadata": {"annotations": {keys.BARRIER_ACK: text}}},
                _preload_content=False,
            )
            response.drain_conn()  # read to its end, undecoded: its connection goes back to the pool
            response.release_conn()
        self.core.release()
