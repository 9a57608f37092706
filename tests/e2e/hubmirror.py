"""A local stand-in for the Hugging Face Hub: serves folders as model repositories over HTTP.

Point ``HF_ENDPOINT`` at :attr:`HubMirror.url` and ``huggingface_hub`` (so transformers and
ftjob) downloads ``hf://org/name`` from here. It answers the four requests a
``snapshot_download`` makes -- the revision's info, the file tree, and HEAD/GET of each file
-- and counts them, so that a test can tell a download from a cache hit. For the dataset
repositories in ``datasets`` it answers the revision's info only (which commit a revision
names now: :attr:`commit`, which a test may move), counted as "dataset info".
"""

from __future__ import annotations

import collections
import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def serve(handler: type[BaseHTTPRequestHandler]) -> tuple[ThreadingHTTPServer, str]:
    """Serve ``handler`` on a free loopback port from a thread; the server and its URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def stop(server: ThreadingHTTPServer) -> None:
    server.shutdown()
    server.server_close()


class HubMirror:
    def __init__(self, repos: dict[str, Path], datasets: tuple[str, ...] = ()):
        self.repos, self.datasets, self.commit = repos, datasets, COMMIT
        # Status codes the next requests get instead of their answer, one each (a busy Hub:
        # 429, 503; a refusal: 401), and one that every request gets while set.
        self.answers: list[int] = []
        self.always: int | None = None
        self.requests: collections.Counter[str] = collections.Counter()
        mirror = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                mirror._answer(self, body=True)

            def do_HEAD(self):  # noqa: N802
                mirror._answer(self, body=False)

            def log_message(self, *args):
                pass

        self.server, self.url = serve(Handler)

    def close(self) -> None:
        stop(self.server)

    def downloads(self, filename: str) -> int:
        """How many times the file's bytes were sent (GET), over all repositories."""
        return sum(n for key, n in self.requests.items() if key == f"GET file {filename}")

    def _files(self, repo: str) -> dict[str, Path]:
        root = self.repos[repo]
        return {str(p.relative_to(root)): p for p in sorted(root.rglob("*")) if p.is_file()}

    def _answer(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        status = self.answers.pop(0) if self.answers else self.always
        if status is not None:
            self.requests[f"answered {status}"] += 1
            h.send_response(status)
            h.send_header("Content-Length", "0")
            h.end_headers()
            return None
        path = unquote(urlparse(h.path).path)
        for repo in self.datasets:
            if path == f"/api/datasets/{repo}" or path.startswith(
                f"/api/datasets/{repo}/revision/"
            ):
                self.requests["dataset info"] += 1
                return _json(h, {"id": repo, "sha": self.commit, "siblings": []}, body)
        for repo in self.repos:
            info = f"/api/models/{repo}/revision/"
            tree = f"/api/models/{repo}/tree/"
            resolve = f"/{repo}/resolve/"
            if path.startswith(info):
                self.requests["info"] += 1
                siblings = [{"rfilename": f} for f in self._files(repo)]
                return _json(h, {"id": repo, "sha": self.commit, "siblings": siblings}, body)
            if path.startswith(tree):
                self.requests["tree"] += 1
                entries = [
                    {"type": "file", "path": name, "size": p.stat().st_size, "oid": _oid(p)}
                    for name, p in self._files(repo).items()
                ]
                return _json(h, entries, body)
            if path.startswith(resolve):
                name = path[len(resolve) :].split("/", 1)[1]
                file = self._files(repo).get(name)
                if file is None:
                    h.send_response(404)
                    h.send_header("X-Error-Code", "EntryNotFound")
                    h.end_headers()
                    return None
                self.requests[f"{h.command} file {name}"] += 1
                data = file.read_bytes()
                h.send_response(200)
                h.send_header("X-Repo-Commit", self.commit)
                h.send_header("ETag", f'"{_oid(file)}"')
                h.send_header("Content-Length", str(len(data)))
                h.end_headers()
                if body:
                    h.wfile.write(data)
                return None
        h.send_response(404)
        h.send_header("X-Error-Code", "RepoNotFound")
        h.end_headers()
        return None


def _oid(path: Path) -> str:
    return hashlib.sha1(path.read_bytes()).hexdigest()


def _json(h: BaseHTTPRequestHandler, value, body: bool) -> None:
    data = json.dumps(value).encode()
    h.send_response(200)
    h.send_header("Content-Type", "application/json")
    h.send_header("Content-Length", str(len(data)))
    h.end_headers()
    if body:
        h.wfile.write(data)
