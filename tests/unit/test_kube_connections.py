"""The operator's API client (operator/kube.py) sends one call after another over one kept-alive
connection, whatever the answer: a response left unread keeps its connection, and the next
call opens and TLS-handshakes a new one (at 1,000 jobs every create and delete did; a tenth of
the operator's CPU, and as many handshakes for the API server). A local HTTP/1.1 server counts
the connections the real kubernetes client and urllib3 open."""

from __future__ import annotations

import http.server

import local_api
import pytest

POD = {
    "apiVersion": "v1",
    "kind": "Pod",
    "metadata": {"name": "p", "namespace": "ns"},
    "spec": {"containers": [{"name": "c", "image": "i"}]},
}


@pytest.fixture(params=[201, 409], ids=["created", "already-there"])
def server(request):
    """A server answering every create with the param's status, every delete with 200 (an
    uid-less delete) and every read with the pod; ``.connections``: how many were opened."""
    status = request.param

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the API server's

        def setup(self):
            self.server.connections += 1
            super().setup()

        def _answer(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            code = status if self.command == "POST" else 200
            local_api.answer(self, code, POD if code < 300 else {"kind": "Status", "code": code})

        do_POST = do_DELETE = do_GET = _answer

        def log_message(self, *args):
            pass

    with local_api.serving(Handler, connections=0) as srv:
        yield srv


def test_one_call_after_another_uses_one_connection(server):
    kube = local_api.kube_at(server)
    for _ in range(4):
        kube.create(POD)
        kube.delete("Pod", "ns", "p")
        kube.owners("Pod", "ns", "p")
        kube.pods("ns", "job")
    assert server.connections == 1
