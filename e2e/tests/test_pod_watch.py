"""The operator's own pod watch (lockstep.podwatch) against a real API server: a list, then every change
after it, in order, across the watch requests the API server ends, and only for the pods the selector picks."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from lockstep import podwatch
from lockstep.podwatch import PodWatch
from lockstep_e2e.fixtures import wait_for

SELECTOR = "lockstep-test/watched=yes"


def bare_pod(name: str, **labels: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {"containers": [{"name": "c", "image": "busybox"}], "nodeName": "nowhere"},
    }


class Seen:
    def __init__(self) -> None:
        self.listed: list[str] = []
        self.events: list[tuple[str, str, dict[str, str]]] = []  # (type, pod, annotations)

    def on_list(self, pods: list[dict[str, Any]], revision: str) -> None:
        assert revision.isdigit()
        self.listed = [pod["metadata"]["name"] for pod in pods]

    def on_event(self, kind: str, pod: dict[str, Any]) -> None:
        metadata = pod["metadata"]
        self.events.append((kind, metadata["name"], metadata.get("annotations") or {}))

    def of(self, name: str) -> list[str]:
        return [kind for kind, pod, _ in self.events if pod == name]


@pytest.fixture
def seen(kube: client.ApiClient, namespace: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Seen]:
    monkeypatch.setattr(podwatch, "WATCH_SECONDS", 1)  # the API server ends each watch request after 1 s
    core = client.CoreV1Api(kube)
    core.create_namespaced_pod(namespace, bare_pod("before", **{"lockstep-test/watched": "yes"}))
    core.create_namespaced_pod(namespace, bare_pod("unwatched"))
    found = Seen()
    stop = threading.Event()
    watch = PodWatch(core, SELECTOR, found.on_list, found.on_event)
    thread = threading.Thread(target=watch.run, args=(stop,), daemon=True)
    thread.start()
    wait_for(lambda: found.listed, "the watch's first list")
    yield found
    stop.set()
    thread.join(timeout=WAIT)


WAIT = 10


def test_the_pod_watch_lists_then_delivers_each_change_once_across_watch_requests(
    kube: client.ApiClient, namespace: str, seen: Seen
) -> None:
    core = client.CoreV1Api(kube)
    assert seen.listed == ["before"], "the list holds only the pods the selector picks"
    core.create_namespaced_pod(namespace, bare_pod("after", **{"lockstep-test/watched": "yes"}))
    time.sleep(1.5)  # a new watch request goes on from the revision the last one reached
    core.patch_namespaced_pod("after", namespace, {"metadata": {"annotations": {"step": "2"}}})
    time.sleep(1.5)
    core.delete_namespaced_pod("after", namespace, grace_period_seconds=0)
    wait_for(lambda: "DELETED" in seen.of("after"), "the deletion", timeout=WAIT)
    kinds = seen.of("after")
    assert kinds[0] == "ADDED" and kinds[-1] == "DELETED" and set(kinds[1:-1]) <= {"MODIFIED"}, kinds
    assert any(a.get("step") == "2" for kind, pod, a in seen.events if pod == "after" and kind == "MODIFIED")
    assert "ADDED" not in seen.of("before"), "a pod already listed is not delivered again by a later watch request"
    assert not seen.of("unwatched")
