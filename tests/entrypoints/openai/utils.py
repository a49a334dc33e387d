"""A real `minivllm serve` in a subprocess on a free port, and small raw-HTTP helpers."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

START_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RemoteServer:
    """`python -m minivllm.entrypoints.cli serve ARGS` until stop(); ready once /health is 200."""

    def __init__(
        self,
        args: list[str],
        env: dict[str, str] | None = None,
        module: str = "minivllm.entrypoints.cli serve",
        cwd: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        """`module` is what `python -m` runs (the demo server, vLLM's api_server path);
        ssl_context: the server serves HTTPS (--ssl-certfile), trusted by this context."""
        self.host, self.port = "127.0.0.1", free_port()
        self.ssl_context = ssl_context
        self.log = tempfile.NamedTemporaryFile(
            "w+", prefix="minivllm-serve-", suffix=".log", delete=False
        )
        cmd = [sys.executable, "-m", *module.split()]
        cmd += ["--host", self.host, "--port", str(self.port), *args]
        full_env = {**os.environ, "MINIVLLM_CPU_KVCACHE_SPACE": "0.25", **(env or {})}
        self.proc = subprocess.Popen(
            cmd,
            env=full_env,
            cwd=cwd,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            self._wait_until_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_until_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited during start-up:\n{self.log_text()}")
            try:
                url = self.url_for("health")
                with urllib.request.urlopen(url, timeout=5, context=self.ssl_context) as response:
                    if response.status == 200:
                        return
            except (OSError, urllib.error.URLError):
                pass
            # A server is up ~0.25 s sooner on average than at 0.5 s polls, on each of the
            # suite's ~50 starts; a refused connection costs next to nothing.
            time.sleep(0.1)
        raise TimeoutError(f"the server was not ready in {START_TIMEOUT_S} s:\n{self.log_text()}")

    @property
    def url_root(self) -> str:
        scheme = "https" if self.ssl_context is not None else "http"
        return f"{scheme}://{self.host}:{self.port}"

    def url_for(self, *parts: str) -> str:
        return "/".join([self.url_root, *parts])

    def log_text(self) -> str:
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return f.read()

    def get_client(self, api_key: str = "EMPTY", **kwargs):
        import openai

        return openai.OpenAI(
            base_url=self.url_for("v1"), api_key=api_key, max_retries=0, timeout=120, **kwargs
        )

    def get_async_client(self, api_key: str = "EMPTY", **kwargs):
        import openai

        return openai.AsyncOpenAI(
            base_url=self.url_for("v1"), api_key=api_key, max_retries=0, timeout=120, **kwargs
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)

    def kill(self) -> None:
        """The end of a test that signals the server itself: SIGKILL if it still runs, then
        stop()'s clean-up (a log already gone is no error)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        with contextlib.suppress(OSError):
            self.stop()

    def child_pids(self) -> list[int]:
        """Processes whose parent is the server (the engine core, multiprocessing helpers)."""
        pids = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == self.proc.pid:
                pids.append(int(entry))
        return pids

    def engine_core_pid(self) -> int:
        for pid in self.child_pids():
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
            if b"spawn_main" in cmdline:
                return pid
        raise RuntimeError("no engine core process found")


def request(
    method: str,
    url: str,
    body: bytes | dict | list | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 120,
) -> tuple[int, dict[str, str], bytes]:
    """One HTTP request; (status, lower-cased headers, body), whatever the status."""
    data = json.dumps(body).encode() if isinstance(body, (dict, list)) else body
    all_headers = {"Content-Type": "application/json"} if data is not None else {}
    all_headers.update(headers or {})
    req = urllib.request.Request(url, data=data, headers=all_headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as response:
            return response.status, _lower(response.headers), response.read()
    except urllib.error.HTTPError as err:
        return err.code, _lower(err.headers), err.read()


def _lower(headers) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items()}


def post_json(url: str, body, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    status, _, data = request("POST", url, body, headers)
    return status, json.loads(data) if data else {}


def metrics(server: RemoteServer) -> dict[str, float]:
    """The server's Prometheus samples: 'name{labels}' -> value (labels sorted)."""
    status, _, data = request("GET", server.url_for("metrics"))
    assert status == 200
    samples = {}
    for line in data.decode().splitlines():
        if not line or line.startswith("#"):
            continue
        key, value = line.rsplit(" ", 1)
        samples[key] = float(value)
    return samples


def metric(samples: dict[str, float], name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include these."""
    total, found = 0.0, False
    for key, value in samples.items():
        match = re.fullmatch(r"([^{]+)(?:\{(.*)\})?", key)
        if match.group(1) != name:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += value
            found = True
    assert found, f"no sample of {name} {labels}"
    return total


def open_stream(server: RemoteServer, path: str, body: dict) -> http.client.HTTPConnection:
    """POST a streaming request and return the connection, its response started."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    return conn
