"""Leader election: of the operator's replicas, at most one acts, through a coordination.k8s.io/v1 Lease.

Why a Lease and not kopf's peering: kopf pauses every operator when it sees peers of the same
priority (the replicas of one Deployment all have the same), so peering picks no leader; it also
needs its own CRDs, and it has no renew deadline. A Lease is built into Kubernetes, `kubectl get
lease -n lockstep-system` shows who leads, and it is what kube-controller-manager and
controller-runtime use, with the same rules (client-go's leaderelection):

- ``acquire()`` blocks until this replica holds the Lease. It takes the Lease when nobody holds
  it, or when the holder's record has not changed for the holder's ``leaseDurationSeconds``, as
  timed by this replica's own clock from when it first saw that record (no comparison of clocks
  across machines). While it waits, it does nothing else.
- The leader renews every ``RETRY_PERIOD``. When no renewal has succeeded within ``RENEW_DEADLINE``
  of when the last successful one was sent, or another replica holds the Lease, the process exits
  at once (status 1; the Deployment restarts it as a standby). ``RENEW_DEADLINE`` is shorter than
  ``LEASE_DURATION``, so a leader that cannot renew is gone before any standby sees the Lease expire:
  two replicas never act at once.
- ``release()`` (after a clean stop, once the operator has finished acting) hands the Lease back,
  so a standby takes over at its next try instead of after ``LEASE_DURATION``.

A takeover after the leader dies therefore starts at most ``LEASE_DURATION + 2 * RETRY_PERIOD`` after
the leader's last renewal.
"""

from __future__ import annotations

import datetime as dt
import http.server
import json
import logging
import os
import socket
import threading
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from lockstep import responses

LEASE_NAME = "lockstep-operator"
LEASE_DURATION = 8.0
RENEW_DEADLINE = 5.0
RETRY_PERIOD = 1.0
EXIT_STATUS = 1

logger = logging.getLogger("lockstep.leader")
_TRANSIENT = (ApiException, urllib3.exceptions.HTTPError, OSError)


class LeaseLost(Exception):
    """Another replica holds the Lease."""


def identity() -> str:
    """This replica's name in the Lease: its pod name (HOSTNAME) and a random suffix, unique per process."""
    return f"{os.environ.get('HOSTNAME') or socket.gethostname()}_{uuid.uuid4().hex[:8]}"


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")  # a MicroTime


class LeaderElector:
    """Holds (or waits for) the Lease ``namespace/name`` as ``holder``; see the module docstring."""

    def __init__(self, api_client: client.ApiClient, namespace: str, name: str, holder: str) -> None:
        self.leases = client.CoordinationV1Api(api_client)
        self.namespace, self.name, self.holder = namespace, name, holder
        self._lease: dict[str, Any] = {}  # the Lease as last read or written
        self._observed_at = 0.0  # monotonic time at which the current record was first seen
        self._deadline = 0.0  # monotonic time by which a renewal must succeed
        self._stop_renewing = threading.Event()
        self._renewer = threading.Thread(target=self._renew_until_stopped, name="lease-renewer", daemon=True)

    @property
    def lease(self) -> str:
        return f"Lease {self.namespace}/{self.name}"

    def acquire(self) -> None:
        """Block until this replica holds the Lease, then keep renewing it in a background thread."""
        logger.info(
            "leader election: this replica is %s; it reconciles only while it holds the %s", self.holder, self.lease
        )
        waiting_for = None
        while True:
            sent = time.monotonic()
            try:
                if self._try_acquire():
                    break
                current = self._lease["spec"].get("holderIdentity")
                if current != waiting_for:
                    waiting_for = current
                    logger.info(
                        "standing by: %s holds the %s; taking over if it is not renewed for %.0f s",
                        current,
                        self.lease,
                        self._duration(),
                    )
            except _TRANSIENT as error:
                logger.warning(
                    "could not read or take the %s: %s; retrying in %.0f s", self.lease, _why(error), RETRY_PERIOD
                )
            time.sleep(RETRY_PERIOD)
        self._deadline = sent + RENEW_DEADLINE
        logger.info("became the leader: this replica (%s) holds the %s and starts reconciling", self.holder, self.lease)
        self._renewer.start()

    def release(self) -> None:
        """Stop renewing and hand the Lease back (call only once the operator no longer acts)."""
        self._stop_renewing.set()
        self._renewer.join()
        spec = {**self._lease["spec"], "holderIdentity": None, "leaseDurationSeconds": 1, "renewTime": _now()}
        try:
            self._replace(spec)
            logger.info("released the %s", self.lease)
        except _TRANSIENT as error:
            logger.warning("could not release the %s (a standby takes it when it expires): %s", self.lease, _why(error))

    # -- internals -------------------------------------------------------------------------

    def _duration(self) -> float:
        return float(self._lease["spec"].get("leaseDurationSeconds") or LEASE_DURATION)

    def _try_acquire(self) -> bool:
        try:
            lease = responses.body(self.leases.read_namespaced_lease(self.name, self.namespace, _preload_content=False))
        except ApiException as error:
            if error.status != 404:
                raise
            return self._create()
        if lease["metadata"]["resourceVersion"] != self._lease.get("metadata", {}).get("resourceVersion"):
            self._observed_at = time.monotonic()
        self._lease = lease
        spec = lease["spec"]
        current = spec.get("holderIdentity")
        if current and time.monotonic() < self._observed_at + self._duration():
            return False
        now = _now()
        taken = {**self._spec(now), "acquireTime": now, "leaseTransitions": int(spec.get("leaseTransitions") or 0) + 1}
        try:
            self._replace(taken)
        except ApiException as error:
            if error.status == 409:
                return False  # another standby was quicker
            raise
        if current:
            logger.info("%s did not renew the %s for %.0f s: taking over", current, self.lease, self._duration())
        return True

    def _create(self) -> bool:
        now = _now()
        body: Any = {  # a plain dict: the client's model would drop a MicroTime's zero microseconds
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": self.name, "namespace": self.namespace},
            "spec": {**self._spec(now), "acquireTime": now, "leaseTransitions": 0},
        }
        try:
            self._lease = responses.body(
                self.leases.create_namespaced_lease(self.namespace, body, _preload_content=False)
            )
        except ApiException as error:
            if error.status == 409:
                return False  # another replica created it first
            raise
        return True

    def _spec(self, now: str) -> dict[str, Any]:
        return {
            **self._lease.get("spec", {}),
            "holderIdentity": self.holder,
            "leaseDurationSeconds": int(LEASE_DURATION),
            "renewTime": now,
        }

    def _replace(self, spec: dict[str, Any], timeout: float | None = None) -> None:
        """Write ``spec`` over the Lease as last seen (a 409 if anyone wrote it since)."""
        body: Any = {**self._lease, "spec": spec}
        self._lease = responses.body(
            self.leases.replace_namespaced_lease(
                self.name, self.namespace, body, _preload_content=False, _request_timeout=timeout
            )
        )

    def _renew(self, timeout: float) -> None:
        try:
            self._replace(self._spec(_now()), timeout)
        except ApiException as error:
            if error.status != 409:
                raise
            self._lease = responses.body(
                self.leases.read_namespaced_lease(
                    self.name, self.namespace, _preload_content=False, _request_timeout=timeout
                )
            )
            current = self._lease["spec"].get("holderIdentity")
            if current != self.holder:
                raise LeaseLost(f"{current or 'nobody'} holds it now") from error
            raise  # our own Lease, written by someone else (a label, say): renew at the next try

    def _renew_until_stopped(self) -> None:
        while not self._stop_renewing.wait(max(0.0, min(RETRY_PERIOD, self._deadline - time.monotonic()))):
            sent = time.monotonic()
            try:
                self._renew(timeout=max(0.1, self._deadline - sent))
                self._deadline = sent + RENEW_DEADLINE
            except LeaseLost as lost:
                _exit(f"lost the {self.lease}: {lost}")
            except _TRANSIENT as error:
                logger.warning("could not renew the %s: %s; retrying", self.lease, _why(error))
            if time.monotonic() >= self._deadline and not self._stop_renewing.is_set():
                _exit(f"could not renew the {self.lease} within {RENEW_DEADLINE:.0f} s")


def _why(error: Exception) -> str:
    """One line for the log: the API server's status and message, not the client's dump of headers."""
    if isinstance(error, ApiException):
        try:
            return f"{error.status} {json.loads(error.body or '')['message']}"
        except (ValueError, KeyError):
            return f"{error.status} {error.reason}"
    return str(error)


def _exit(why: str) -> None:
    """Stop acting at once: a leader that may have lost its Lease must not write another thing."""
    logger.critical(
        "%s; exiting now so that two replicas never act at once (a Deployment restarts it as a standby)", why
    )
    os._exit(EXIT_STATUS)


@contextmanager
def liveness_while_standing_by(url: str | None) -> Iterator[None]:
    """Answer the liveness probe at ``url`` (kopf's format, http://HOST:PORT/PATH) for the duration of the
    block, so that the kubelet keeps a standby running; kopf serves it once this replica leads."""
    if url is None:
        yield
        return
    parts = urllib.parse.urlsplit(url)
    path = parts.path or "/"

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            found = self.path.split("?")[0] == path
            self.send_response(200 if found else 404)
            self.end_headers()
            if found:
                self.wfile.write(b'{"standby": true}\n')

        def log_message(self, format: str, *args: Any) -> None:
            """Probes every few seconds would only be noise in the log."""

    server = http.server.ThreadingHTTPServer((parts.hostname or "localhost", parts.port or 80), Handler)
    thread = threading.Thread(target=server.serve_forever, name="standby-liveness", daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()
