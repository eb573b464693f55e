"""A played Hugging Face Hub on loopback: the few endpoints huggingface_hub's own download calls (read
in its code, huggingface_hub 1.16: README.md here), serving models made by the test, counting every
request per file, and writing a log of them that holds no header's value (the test asserts no token
is in it). huggingface_hub reaches it through HF_ENDPOINT."""

from __future__ import annotations

import hashlib
import json
import re
import struct
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

API = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+|[^/]+)(?:/revision/(?P<rev>[^/?]+))?(?:\?.*)?$")
RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+|[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>[^?]+)(?:\?.*)?$")
CDN = re.compile(r"^/cdn/(?P<sha256>[0-9a-f]{64})$")


def tiny_model(seed: int = 0, weights_kb: int = 256) -> dict[str, bytes]:
    """A small model's files as the hub holds a transformers model: its config, a tokenizer file, and
    its weights in the safetensors format (an 8-byte header length, the JSON header, the raw tensor)."""
    numbers = bytes((seed + i * 7) % 251 for i in range(weights_kb * 1024))
    header = json.dumps({"embed.weight": {"dtype": "U8", "shape": [len(numbers)], "data_offsets": [0, len(numbers)]},
                         "__metadata__": {"format": "pt"}}).encode()
    weights = struct.pack("<Q", len(header)) + header + numbers
    config = json.dumps({"model_type": "tiny", "hidden_size": 8, "seed": seed}).encode()
    return {"config.json": config, "tokenizer.json": b'{"version": "1.0", "model": {"vocab": {}}}',
            "model.safetensors": weights}


def git_sha1(content: bytes) -> str:
    """A file's git blob id: the ETag the hub gives a file kept in git (not LFS)."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


class PlayedHub:
    """Models by repo id; `token`: the one token it accepts (then a request without it is refused, as for
    a gated repo). Files ending in .safetensors are played as LFS files are served: the resolve URL
    redirects to a CDN address with the linked ETag (sha256) and size."""

    def __init__(self, models: dict[str, dict[str, bytes]], log: Path, token: str | None = None):
        self.models, self.token, self.log = models, token, log
        self.commits = {repo: hashlib.sha1(repr(sorted(files.items())).encode()).hexdigest()
                        for repo, files in models.items()}
        self.blobs = {hashlib.sha256(content).hexdigest(): (repo, name, content)
                      for repo, files in models.items() for name, content in files.items()}
        self.requests: Counter = Counter()  # (method, repo, file or "api") -> count
        self.lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                hub.answer(self, "GET")

            def do_HEAD(self):
                hub.answer(self, "HEAD")

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "PlayedHub":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def count(self, method: str, repo: str, what: str) -> int:
        with self.lock:
            return self.requests[(method, repo, what)]

    def total(self) -> int:
        with self.lock:
            return sum(self.requests.values())

    def _note(self, method: str, repo: str, what: str, status: int, authorized: bool) -> None:
        with self.lock:
            self.requests[(method, repo, what)] += 1
            with self.log.open("a") as handle:  # what was asked, never a header's value
                handle.write(f"{method} {repo} {what} {status} token={'yes' if authorized else 'no'}\n")

    def answer(self, req: BaseHTTPRequestHandler, method: str) -> None:
        given = req.headers.get("Authorization", "")
        authorized = bool(self.token) and given == f"Bearer {self.token}"
        if self.token and given and not authorized:
            return self._send(req, 401, {"X-Error-Message": "Invalid credentials in Authorization header"},
                              {"error": "Invalid credentials in Authorization header"}, method)
        api, resolve, cdn = API.match(req.path), RESOLVE.match(req.path), CDN.match(req.path)
        repo = (api or resolve).group("repo") if (api or resolve) else None
        if cdn:
            found = self.blobs.get(cdn.group("sha256"))
            if found is None:
                return self._send(req, 404, {}, {"error": "Entry not found"}, method)
            self._note(method, found[0], found[1] + " (cdn)", 200, authorized)
            return self._file(req, method, found[2])
        if repo is None:
            return self._send(req, 404, {}, {"error": "Not found"}, method)
        if repo not in self.models or (self.token and not authorized):
            # The hub answers an unknown repo (or one the request may not see) 401 without a token, 404 with
            # one, both with X-Error-Code RepoNotFound (huggingface_hub/utils/_http.py, hf_raise_for_status).
            status = 404 if given else 401
            self._note(method, repo, "api" if api else resolve.group("path"), status, authorized)
            return self._send(req, status, {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"},
                              {"error": "Repository not found"}, method)
        commit, files = self.commits[repo], self.models[repo]
        if api:
            self._note(method, repo, "api", 200, authorized)
            return self._send(req, 200, {}, {"id": repo, "modelId": repo, "sha": commit, "private": False,
                                             "siblings": [{"rfilename": name} for name in sorted(files)]}, method)
        name = resolve.group("path")
        if name not in files:
            self._note(method, repo, name, 404, authorized)
            return self._send(req, 404, {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": commit},
                              {"error": "Entry not found"}, method)
        self._note(method, repo, name, 200, authorized)
        content = files[name]
        if name.endswith(".safetensors"):  # an LFS file: to the CDN, as the hub redirects
            sha256 = hashlib.sha256(content).hexdigest()
            return self._send(req, 302, {"Location": f"{self.url}/cdn/{sha256}", "X-Repo-Commit": commit,
                                         "X-Linked-Etag": f'"{sha256}"', "X-Linked-Size": str(len(content)),
                                         "ETag": f'"{git_sha1(content)}"'}, None, method)
        return self._file(req, method, content, {"X-Repo-Commit": commit, "ETag": f'"{git_sha1(content)}"'})

    def _file(self, req, method: str, content: bytes, headers: dict | None = None) -> None:
        headers = dict(headers or {})
        status, body = 200, content
        match = re.match(r"bytes=(\d+)-(\d*)$", req.headers.get("Range", ""))
        if match:  # a resumed download (http_get's Range)
            start = int(match.group(1))
            end = int(match.group(2)) if match.group(2) else len(content) - 1
            status, body = 206, content[start:end + 1]
            headers["Content-Range"] = f"bytes {start}-{end}/{len(content)}"
        req.send_response(status)
        for key, value in headers.items():
            req.send_header(key, value)
        req.send_header("Content-Length", str(len(body)))
        req.end_headers()
        if method == "GET":
            req.wfile.write(body)

    @staticmethod
    def _send(req, status: int, headers: dict, data, method: str) -> None:
        body = json.dumps(data).encode() if data is not None else b""
        req.send_response(status)
        for key, value in headers.items():
            req.send_header(key, value)
        if data is not None:
            req.send_header("Content-Type", "application/json")
        req.send_header("Content-Length", str(len(body)))
        req.end_headers()
        if method == "GET":
            req.wfile.write(body)
