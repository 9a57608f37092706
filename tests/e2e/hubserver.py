"""A local stand-in for the Hugging Face Hub's upload API, as ``huggingface_hub`` calls it.

Point ``HF_ENDPOINT`` at :attr:`HubServer.url` (with ``HF_HUB_DISABLE_XET=1``: this server
speaks Git LFS's basic transfer, not Xet) and ``HfApi.create_repo`` / ``create_commit`` /
``upload_folder`` upload here. It answers what those call (read from huggingface_hub's
``hf_api.py``, ``_commit_api.py`` and ``lfs.py``):

* ``POST /api/repos/create`` -- 409 when the repository exists (``exist_ok`` takes that);
* ``POST /api/validate-yaml`` -- a README.md's metadata, before anything is uploaded;
* ``POST /api/models/{repo}/preupload/{revision}`` -- each file's upload mode: ``lfs`` for
  weights and binary files (as the Hub's .gitattributes does), else ``regular``;
* ``POST /{repo}.git/info/lfs/objects/batch`` -- an upload action per object not stored yet;
* ``PUT`` of each object to the action's URL (its sha256 checked), then the verify ``POST``;
* ``POST /api/models/{repo}/commit/{revision}`` -- the NDJSON commit: header, ``file``
  (base64 inline) and ``lfsFile`` (an uploaded object) lines; the files land in
  :meth:`folder`.

Set :attr:`commit_delay` to answer the commits that succeed that many seconds late, as the
commit of a large upload may be.

Every request must carry ``Authorization: Bearer <token>`` (401 otherwise), but the object
uploads: their URLs are signed, as the Hub's pre-signed storage URLs are. Set
:attr:`fail_commits` to answer that many commits with 500, as a Hub outage would.
"""

from __future__ import annotations

import base64
import collections
import hashlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from urllib.parse import unquote, urlparse

from hubmirror import serve, stop

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".model", ".gguf")
LFS_MIN_BYTES = 10 * 2**20


class HubServer:
    def __init__(self, root: Path, token: str):
        self.root, self.token = root, token
        self.repos: dict[str, dict] = {}  # repo id -> {"private": bool, "commits": [...]}
        self.objects: dict[str, bytes] = {}  # LFS objects by sha256
        self.requests: collections.Counter[str] = collections.Counter()
        self.fail_commits = 0
        self.commit_delay = 0.0
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as httpx expects

            def do_POST(self):  # noqa: N802 - http.server's name
                server._answer(self)

            def do_PUT(self):  # noqa: N802
                server._answer(self)

            def log_message(self, *args):
                pass

        self.server, self.url = serve(Handler)

    def close(self) -> None:
        stop(self.server)

    def folder(self, repo: str) -> Path:
        """The repository's files as its latest commit left them."""
        return self.root / repo

    def commits(self, repo: str) -> list[dict]:
        return self.repos.get(repo, {}).get("commits", [])

    # ---------------------------------------------------------------------------- requests

    def _answer(self, h: BaseHTTPRequestHandler) -> None:
        url = urlparse(h.path)
        path = unquote(url.path)
        body = _read_body(h)
        if h.command == "PUT" and path.startswith("/lfs-upload/"):
            oid = path.removeprefix("/lfs-upload/")
            if url.query != f"sig={self._sign(oid)}":
                return _reply(h, 403, {"error": "bad signature"})
            with self.lock:
                return self._store_object(h, oid, body)
        if h.headers.get("Authorization") != f"Bearer {self.token}":
            self.requests["unauthorized"] += 1
            return _reply(h, 401, {"error": "Invalid credentials in Authorization header"})
        with self.lock:
            if h.command == "POST" and path == "/api/repos/create":
                return self._create(h, json.loads(body))
            if h.command == "POST" and path == "/api/validate-yaml":
                self.requests["validate-yaml"] += 1
                return _reply(h, 200, {"errors": [], "warnings": []})
            if h.command == "POST" and path == "/lfs-verify":
                oid = json.loads(body)["oid"]
                return _reply(h, 200 if oid in self.objects else 404, {})
            if h.command == "POST" and path.endswith(".git/info/lfs/objects/batch"):
                return self._batch(h, json.loads(body))
            for kind in ("preupload", "commit"):
                marker = f"/{kind}/"
                if h.command == "POST" and path.startswith("/api/models/") and marker in path:
                    repo = path.removeprefix("/api/models/").split(marker)[0]
                    if repo not in self.repos:
                        return _reply(h, 404, {"error": f"Repository {repo} not found"},
                                      {"X-Error-Code": "RepoNotFound"})  # fmt: skip
                    if kind == "preupload":
                        return self._preupload(h, json.loads(body))
                    break
            else:
                return _reply(h, 404, {"error": f"not served here: {h.command} {path}"})
        if not self.fail_commits:  # a commit that will succeed takes its time
            time.sleep(self.commit_delay)  # outside the lock: other requests go on meanwhile
        with self.lock:
            return self._commit(h, repo, body)

    def _create(self, h, payload: dict) -> None:
        repo = f"{payload['organization']}/{payload['name']}"
        self.requests["create"] += 1
        if repo in self.repos:
            # The Hub names the repository in its 409 too; create_repo(exist_ok=True) reads it.
            return _reply(h, 409, {"error": "You already created this model repo",
                                   "url": f"{self.url}/{repo}"})  # fmt: skip
        self.repos[repo] = {"private": payload.get("visibility") == "private", "commits": []}
        return _reply(h, 200, {"url": f"{self.url}/{repo}", "name": repo})

    def _preupload(self, h, payload: dict) -> None:
        self.requests["preupload"] += 1
        files = []
        for f in payload["files"]:
            sample = base64.b64decode(f["sample"])
            lfs = f["path"].endswith(LFS_SUFFIXES) or f["size"] >= LFS_MIN_BYTES or b"\0" in sample
            files.append({"path": f["path"], "uploadMode": "lfs" if lfs else "regular",
                          "shouldIgnore": False, "oid": None})  # fmt: skip
        return _reply(h, 200, {"files": files, "commitOid": None})

    def _batch(self, h, payload: dict) -> None:
        self.requests["lfs batch"] += 1
        objects = []
        for o in payload["objects"]:
            entry = {"oid": o["oid"], "size": o["size"], "authenticated": True}
            if o["oid"] not in self.objects:
                entry["actions"] = {
                    "upload": {
                        "href": f"{self.url}/lfs-upload/{o['oid']}?sig={self._sign(o['oid'])}"
                    },
                    "verify": {"href": f"{self.url}/lfs-verify"},
                }
            objects.append(entry)
        return _reply(h, 200, {"transfer": "basic", "objects": objects})

    def _sign(self, oid: str) -> str:
        return hashlib.sha256(f"{self.token}:{oid}".encode()).hexdigest()[:16]

    def _store_object(self, h, oid: str, data: bytes) -> None:
        self.requests["lfs upload"] += 1
        if hashlib.sha256(data).hexdigest() != oid:
            return _reply(h, 400, {"error": "sha256 does not match the object id"})
        self.objects[oid] = data
        return _reply(h, 200, {})

    def _commit(self, h, repo: str, body: bytes) -> None:
        self.requests["commit"] += 1
        if self.fail_commits > 0:
            self.fail_commits -= 1
            return _reply(h, 500, {"error": "Internal Error - We're working hard to fix this"})
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        files: dict[str, bytes] = {}
        for line in lines:
            value = line["value"]
            if line["key"] == "file":
                files[value["path"]] = base64.b64decode(value["content"])
            elif line["key"] == "lfsFile":
                if value["oid"] not in self.objects:
                    return _reply(h, 422, {"error": f"LFS object {value['oid']} not uploaded"})
                files[value["path"]] = self.objects[value["oid"]]
        for name, data in files.items():
            target = self.folder(repo) / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        oid = hashlib.sha1(body).hexdigest()
        header = lines[0]["value"] if lines and lines[0]["key"] == "header" else {}
        self.repos[repo]["commits"].append({"oid": oid, "summary": header.get("summary"),
                                            "files": sorted(files)})  # fmt: skip
        url = f"{self.url}/{repo}/commit/{oid}"
        return _reply(h, 200, {"commitUrl": url, "commitOid": oid, "pullRequestUrl": None})


def _read_body(h: BaseHTTPRequestHandler) -> bytes:
    """The request's body, sent with a Content-Length or chunked (a streamed file)."""
    if h.headers.get("Transfer-Encoding", "").lower() == "chunked":
        parts = []
        while True:
            size = int(h.rfile.readline().split(b";")[0].strip(), 16)
            if size == 0:
                h.rfile.readline()
                return b"".join(parts)
            parts.append(h.rfile.read(size))
            h.rfile.readline()
    return h.rfile.read(int(h.headers.get("Content-Length") or 0))


def _reply(h: BaseHTTPRequestHandler, code: int, value, headers: dict | None = None) -> None:
    data = json.dumps(value).encode()
    h.send_response(code)
    h.send_header("Content-Type", "application/json")
    h.send_header("Content-Length", str(len(data)))
    for k, v in (headers or {}).items():
        h.send_header(k, v)
    h.end_headers()
    h.wfile.write(data)
