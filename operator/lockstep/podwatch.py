"""The operator's one watch on its pods: label-selected, every namespace, read as raw JSON lines.

A kopf handler per pod event cost more CPU than the rest of the operator together in a 1024-actor barrier (a
worker task per pod, a deep-copied diff base and progress storage per event); this watch hands each event to a
callback as the API server sent it. It lists first and watches from the list's resourceVersion, with bookmarks;
when that revision has expired (410 Gone) it lists again, and the list replaces what the watch had delivered, so
a deletion missed meanwhile is seen too.

Not the kubernetes client's ``Watch.stream``: by default it builds a model object of every event, and with
``deserialize=False`` (kubernetes 37) it fails on the ERROR event that reports an expired revision (it reads the
event's ``raw_object``, which only its decoding sets); this watch reads the response with that module's own line
reader, ``iter_resp_lines``.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from typing import Any

import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines

from lockstep import responses

WATCH_SECONDS = 300
"""How long one watch request lasts before the API server ends it (and the watch goes on from its revision)."""
RETRY_SECONDS = 1.0

logger = logging.getLogger("lockstep.podwatch")


class PodWatch:
    """Calls ``on_list(pods, revision)`` with every pod the ``selector`` matches, then ``on_event(type, pod)``
    (ADDED, MODIFIED or DELETED) for each change after that revision, in order, on one thread."""

    def __init__(
        self,
        core: client.CoreV1Api,
        selector: str,
        on_list: Callable[[list[dict[str, Any]], str], None],
        on_event: Callable[[str, dict[str, Any]], None],
    ) -> None:
        self.core = core
        self.selector = selector
        self.on_list = on_list
        self.on_event = on_event

    def run(self, stop: threading.Event) -> None:
        """Watch until ``stop`` is set; a failure is logged and the watch tried again."""
        revision: str | None = None
        while not stop.is_set():
            try:
                if revision is None:
                    revision = self._list()
                revision = self._watch(revision, stop)
            except (ApiException, urllib3.exceptions.HTTPError, OSError, ValueError) as error:
                logger.warning("watching Lockstep's pods failed (%s); trying again in %.0f s", error, RETRY_SECONDS)
                revision = None  # list again: events may have been missed
                stop.wait(RETRY_SECONDS)

    def _list(self) -> str:
        response: Any = self.core.list_pod_for_all_namespaces(label_selector=self.selector, _preload_content=False)
        listed = responses.body(response)
        revision: str = listed["metadata"]["resourceVersion"]
        self.on_list(listed["items"], revision)
        return revision

    def _watch(self, revision: str, stop: threading.Event) -> str | None:
        """Deliver the events after ``revision``; the revision to go on from, or None to list again (410)."""
        response: Any = self.core.list_pod_for_all_namespaces(
            label_selector=self.selector,
            watch=True,
            resource_version=revision,
            allow_watch_bookmarks=True,
            timeout_seconds=WATCH_SECONDS,
            _preload_content=False,
            _request_timeout=(10, WATCH_SECONDS + 30),
        )
        try:
            for line in iter_resp_lines(response):
                event = json.loads(line)
                kind, pod = event["type"], event["object"]
                if kind == "ERROR":
                    if pod.get("code") == 410:
                        return None  # the revision is too old: list again
                    raise ApiException(status=pod.get("code"), reason=pod.get("message"))
                revision = pod["metadata"]["resourceVersion"]
                if kind != "BOOKMARK":
                    self.on_event(kind, pod)
                if stop.is_set():
                    break
        finally:
            response.close()
        return revision
