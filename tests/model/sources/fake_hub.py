"""A small Hugging Face Hub on 127.0.0.1, in the Hub's URL layout, for the download tests.

It serves folders of files as model repositories to the real ``huggingface_hub`` client
(pointed at it with ``HF_ENDPOINT``): repo info, the recursive file tree, and each file
under ``/{repo}/resolve/{revision}/{path}`` with HEAD, ranges (resumed downloads) and the
headers the client reads (``X-Repo-Commit``, ``ETag``, ``Content-Length``). A repo can be
marked gated (401) and a file can be cut after some bytes, a number of times, to test resuming.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class FakeHub:
    repos: dict[str, dict[str, str]] = field(default_factory=dict)  # repo -> {path: local file}
    gated: set[str] = field(default_factory=set)
    cut_after: dict[tuple[str, str], tuple[int, int]] = field(
        default_factory=dict
    )  # -> (bytes, times)
    requests: list[str] = field(default_factory=list)  # "GET /..." of every file body served
    url: str = ""

    def add_repo(self, repo: str, files: dict[str, str]) -> None:
        self.repos[repo] = dict(files)

    def start(self) -> FakeHub:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                self._serve(body=False)

            def do_GET(self) -> None:
                self._serve(body=True)

            def _json(self, status: int, payload, error_code: str | None = None) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if error_code:
                    self.send_header("X-Error-Code", error_code)
                    self.send_header("X-Error-Message", payload.get("error", ""))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def _repo_or_error(self, repo: str) -> dict[str, str] | None:
                if repo not in hub.repos:
                    self._json(401, {"error": "Repository not found"}, "RepoNotFound")
                    return None
                if repo in hub.gated:
                    self._json(
                        401, {"error": f"Access to model {repo} is restricted."}, "GatedRepo"
                    )
                    return None
                return hub.repos[repo]

            def _serve(self, body: bool) -> None:
                path = self.path.split("?")[0]
                api = re.match(r"^/api/models/(.+?)(?:/revision/([^/]+))?$", path)
                tree = re.match(r"^/api/models/(.+?)/tree/([^/]+)(/.*)?$", path)
                resolve = re.match(r"^/(.+?)/resolve/([^/]+)/(.+)$", path)
                if tree:
                    files = self._repo_or_error(tree.group(1))
                    if files is not None:
                        entries = [
                            {"type": "file", "path": p, "size": os.path.getsize(f), "oid": _oid(f)}
                            for p, f in sorted(files.items())
                        ]
                        self._json(200, entries)
                elif api and "/tree/" not in path:
                    files = self._repo_or_error(api.group(1))
                    if files is not None:
                        siblings = [{"rfilename": p} for p in sorted(files)]
                        self._json(200, {"id": api.group(1), "sha": COMMIT, "siblings": siblings})
                elif resolve:
                    self._file(resolve.group(1), resolve.group(3), body)
                else:
                    self._json(404, {"error": "not found"})

            def _file(self, repo: str, name: str, body: bool) -> None:
                files = self._repo_or_error(repo)
                if files is None:
                    return
                if name not in files:
                    self._json(404, {"error": "Entry not found"}, "EntryNotFound")
                    return
                local = files[name]
                size = os.path.getsize(local)
                start = 0
                m = re.match(r"bytes=(\d+)-", self.headers.get("Range", ""))
                if m:
                    start = int(m.group(1))
                self.send_response(206 if start else 200)
                self.send_header("Content-Length", str(size - start))
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("ETag", f'"{_oid(local)}"')
                self.send_header("X-Repo-Commit", COMMIT)
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{size - 1}/{size}")
                self.end_headers()
                if not body:
                    return
                hub.requests.append(f"GET {repo}/{name} from {start}")
                with open(local, "rb") as f:
                    f.seek(start)
                    data = f.read()
                cut, times = hub.cut_after.get((repo, name), (None, 0))
                if cut is not None and times > 0:
                    hub.cut_after[(repo, name)] = (cut, times - 1)
                    self.wfile.write(data[: max(cut - start, 0)])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)  # the connection drops mid-file
                    return
                self.wfile.write(data)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _oid(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
