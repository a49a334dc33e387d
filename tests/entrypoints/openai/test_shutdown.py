"""Graceful shutdown (issue 20, item 5): SIGINT or SIGTERM with 8 streams in flight ends
every stream with an error event and [DONE], and the server exits within
--shutdown-timeout + 2 s, with no traceback and no process left."""

from __future__ import annotations

import json
import signal
import threading
import time

import pytest

from tests.engine.conftest import wait_gone
from tests.entrypoints.openai.utils import RemoteServer, open_stream

pytestmark = pytest.mark.e2e

SHUTDOWN_TIMEOUT = 1.0
NUM_STREAMS = 8


def _read_stream(conn, first_chunk: threading.Event, events: list[str]) -> None:
    response = conn.getresponse()
    assert response.status == 200
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        events.append(line.removeprefix("data: "))
        first_chunk.set()
    first_chunk.set()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_ends_streams_and_exits(sig):
    server = RemoteServer(["--max-model-len", "512", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT)])
    try:
        children = server.child_pids()
        assert children
        body = {
            "prompt": "Once upon a time",
            "max_tokens": 400,
            "ignore_eos": True,
            "stream": True,
        }
        streams = []
        for _ in range(NUM_STREAMS):
            conn = open_stream(server, "/v1/completions", body)
            first, events = threading.Event(), []
            reader = threading.Thread(target=_read_stream, args=(conn, first, events))
            reader.start()
            streams.append((reader, first, events))
        for _, first, _ in streams:
            assert first.wait(120)
        sent = time.monotonic()
        server.proc.send_signal(sig)
        server.proc.wait(timeout=SHUTDOWN_TIMEOUT + 30)
        exit_s = time.monotonic() - sent
        for reader, _, _ in streams:
            reader.join(30)
        log = server.log_text()
        print(f"{sig.name}: the server exited {exit_s:.2f} s after the signal")
        assert exit_s < SHUTDOWN_TIMEOUT + 2, (exit_s, log[-6000:])
        assert server.proc.returncode == 0, log[-3000:]
        assert "Traceback" not in log and "CancelledError" not in log, log[-5000:]
        for _, _, events in streams:
            assert events[-1] == "[DONE]", events[-3:]
            last = json.loads(events[-2])
            # Ended by the shutdown (an error event) or, rarely, finished in time.
            if "error" in last:
                assert last["error"]["code"] == 503
                assert "shutting down" in last["error"]["message"]
            else:
                assert last["choices"][0]["finish_reason"] == "length"
        assert any("error" in json.loads(events[-2]) for _, _, events in streams)
        for pid in children:
            assert wait_gone(pid, timeout=5), f"process {pid} outlived the server"
    finally:
        server.kill()
