"""The operator's pod writes reuse their connections (a new one costs a TLS handshake on both sides)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from kubernetes import client

from lockstep.kubeclient import write_pod


class _Answer(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the API server
    connections = 0

    def setup(self) -> None:
        super().setup()
        type(self).connections += 1

    def do_PATCH(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        body = b'{"kind": "Pod", "metadata": {"name": "p", "annotations": {"a": "' + b"x" * 20000 + b'"}}}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[ThreadingHTTPServer]:
    _Answer.connections = 0
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Answer)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd
    httpd.shutdown()


def test_pod_writes_in_a_row_share_one_connection(server: ThreadingHTTPServer) -> None:
    configuration = client.Configuration()
    configuration.host = f"http://127.0.0.1:{server.server_address[1]}"
    core = client.CoreV1Api(client.ApiClient(configuration))
    for _ in range(5):
        write_pod(core.patch_namespaced_pod, "p", "ns", {"metadata": {"annotations": {"a": "b"}}})
    assert _Answer.connections == 1, "each write opened a connection of its own"
