"""A local HTTP server standing in for the API server, and a :class:`Kube` that talks to it:
for tests of what kube.py sends and how it reads the answers (tests/unit/test_kube_connections,
test_one_writer). The handler names the answers; the server is the same."""

from __future__ import annotations

import json
import socketserver
import threading
from contextlib import contextmanager

from kubernetes import client

from ftjob.operator.kube import Kube


@contextmanager
def serving(handler, **state):
    """A threaded server on a free loopback port running ``handler``, with ``state`` as its
    attributes (the handler reads and writes them through ``self.server``)."""
    srv = socketserver.ThreadingTCPServer(("127.0.0.1", 0), handler)
    srv.daemon_threads = True
    for name, value in state.items():
        setattr(srv, name, value)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()


def kube_at(srv) -> Kube:
    config = client.Configuration()
    config.host = f"http://127.0.0.1:{srv.server_address[1]}"
    return Kube(client.ApiClient(config))


def answer(handler, code: int, doc: dict) -> None:
    """Send ``doc`` as JSON with status ``code`` (HTTP/1.1, so the connection is kept)."""
    body = json.dumps(doc).encode()
    handler.send_response(code)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)
