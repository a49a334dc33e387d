"""Idle and slow connections against the real server (issue 47): past --max-connections a new
connection closes the longest-idle one, so idle sockets never lock out /health; a connection
that sends no whole request head within --header-timeout is closed."""

from __future__ import annotations

import resource
import socket
import time

import pytest

from tests.entrypoints.openai.utils import RemoteServer, request

pytestmark = pytest.mark.e2e

MAX_CONNECTIONS = 16
HEADER_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def guarded_server():
    remote = RemoteServer(
        [
            "--max-model-len", "64",
            "--max-connections", str(MAX_CONNECTIONS),
            "--header-timeout", str(HEADER_TIMEOUT_S),
        ]
    )  # fmt: skip
    yield remote
    remote.stop()


def _open_idle(server, count: int) -> list[socket.socket]:
    sockets = []
    for _ in range(count):
        sock = socket.create_connection((server.host, server.port), timeout=10)
        sockets.append(sock)
    return sockets


def _health_seconds(server) -> float:
    started = time.monotonic()
    status, _, _ = request("GET", server.url_for("health"), timeout=10)
    assert status == 200
    return time.monotonic() - started


def _closed_by_server(sock: socket.socket, within: float) -> bool:
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except OSError:
        return True


def test_idle_sockets_over_the_cap_leave_health_answering(guarded_server):
    idle = _open_idle(guarded_server, 4 * MAX_CONNECTIONS)
    try:
        # The oldest idle ones were closed to make room (well before the head deadline);
        # the newest are still open.
        assert _closed_by_server(idle[0], within=HEADER_TIMEOUT_S / 3)
        assert not _closed_by_server(idle[-1], within=0.1)
        for _ in range(3):
            assert _health_seconds(guarded_server) < 2.0
    finally:
        for sock in idle:
            sock.close()


def test_a_request_head_that_never_completes_is_cut_off(guarded_server):
    silent, slow = _open_idle(guarded_server, 2)
    try:
        slow.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never the blank line
        assert not _closed_by_server(silent, within=HEADER_TIMEOUT_S / 4)
        assert _closed_by_server(silent, within=HEADER_TIMEOUT_S + 5)
        assert _closed_by_server(slow, within=HEADER_TIMEOUT_S + 5)
        assert _health_seconds(guarded_server) < 2.0
    finally:
        silent.close()
        slow.close()


@pytest.mark.slow
def test_many_idle_sockets_leave_health_answering():
    """The issue's 25,000 idle sockets, as many as this process may open."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    count = min(25_000, hard - 512)
    remote = RemoteServer(["--max-model-len", "64", "--max-connections", "4096"])
    idle: list[socket.socket] = []
    try:
        try:
            idle = _open_idle(remote, count)
        except OSError:
            pass  # the client ran out first: what was opened stays open
        latencies = sorted(_health_seconds(remote) for _ in range(10))
        assert latencies[5] < 0.1 and latencies[-1] < 1.0, latencies
    finally:
        for sock in idle:
            sock.close()
        remote.stop()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
