"""Issue 47's denial-of-service cases as request bodies, for the SIGTERM test
(test_hostile_shutdown.py) and the timing benchmark (benchmarks/hostile_timing.py).

Each case has the attack as the issue sent it (refused with a 400 by the request bounds) and
the costliest request the bounds still serve (it runs, and must not stall the others). The
idle-socket case is connections, not a body: its callers open them."""

from __future__ import annotations

import http.client
import json
import resource
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass

from minivllm.engine import request_limits
from minivllm.entrypoints.openai import protocol

MODEL = "hostile"  # serve with --served-model-name hostile (SERVER_ARGS)
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


@dataclass(frozen=True)
class HostileCase:
    name: str
    path: str
    refused: dict  # the attack: a 400 at once
    served: dict  # the most the bounds allow: served without stalling the others
    concurrent: int = 1  # copies of `served` sent at once


def nested_schema(levels: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"x": schema}, "required": ["x"]}
    return schema


def _completion(max_tokens: int = 64, **fields) -> dict:
    return {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        **fields,
    }


def _json_schema_chat(schema: dict) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Reply with JSON."}],
        "max_tokens": 100,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "deep", "schema": schema},
        },
    }


def _tools_chat(count: int) -> dict:
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "description": f"Tool number {i}.",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                    "required": ["city"],
                },
            },
        }
        for i in range(count)
    ]
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Call a tool."}],
        "max_tokens": 32,
        "tools": tools,
        "tool_choice": "required",
    }


# The schema depth bound counts a level of nesting as two (an object, then its properties).
_SERVED_SCHEMA_LEVELS = request_limits.MAX_SCHEMA_DEPTH // 2 - 1
_VOCAB = 49_152  # the bundled model's

CASES = [
    HostileCase(
        "bad_words",
        COMPLETIONS,
        refused=_completion(bad_words=[f"w{i}" for i in range(30_000)]),
        served=_completion(bad_words=[f"w{i}" for i in range(request_limits.MAX_BAD_WORDS)]),
    ),
    HostileCase(
        "stop_strings",
        COMPLETIONS,
        refused=_completion(400, stop=[f"s{i}" for i in range(100_000)]),
        served=_completion(
            400, stop=[f"stop {i} " * 8 for i in range(request_limits.MAX_STOP_STRINGS)]
        ),
    ),
    HostileCase(
        "deep_schema",
        CHAT,
        refused=_json_schema_chat(nested_schema(450)),
        served=_json_schema_chat(nested_schema(_SERVED_SCHEMA_LEVELS)),
    ),
    HostileCase(
        "prompts_x_n",
        COMPLETIONS,
        refused=_completion(16, prompt=["Hi"] * 1000, n=128),
        served=_completion(16, prompt=["Hi"] * 4, n=protocol.MAX_SEQUENCES_PER_REQUEST // 4),
    ),
    HostileCase(
        "grammar_compile",
        CHAT,
        refused=_tools_chat(5000),
        served=_tools_chat(protocol.MAX_TOOLS),
    ),
    HostileCase(
        "logit_bias",
        COMPLETIONS,
        refused=_completion(logit_bias={str(i): -1 for i in range(_VOCAB)}),
        served=_completion(
            200, logit_bias={str(i): -1 for i in range(request_limits.MAX_LOGIT_BIAS_ENTRIES)}
        ),
        concurrent=32,
    ),
]
SERVER_ARGS = ["--served-model-name", MODEL]
BY_NAME = {case.name: case for case in CASES}
IDLE_SOCKETS = "idle_sockets"


def post(url_root: str, path: str, body: bytes, timeout: float = 120) -> int:
    """POST a JSON body; its HTTP status, or 0 when the connection failed or was cut."""
    req = urllib.request.Request(
        url_root + path, data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as response:
            response.read()
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, OSError, http.client.HTTPException):
        return 0


def start_attack(
    url_root: str, case: HostileCase, stop: threading.Event, statuses: list[int] | None = None
) -> list[threading.Thread]:
    """Threads that send the served request (case.concurrent copies) and the refused one,
    each again as soon as it is answered, until stop is set or the server is gone; each
    answer's status is appended to statuses."""

    def hammer(body: bytes) -> None:
        while not stop.is_set():
            status = post(url_root, case.path, body)
            if statuses is not None:
                statuses.append(status)
            if status == 0:
                return

    served, refused = json.dumps(case.served).encode(), json.dumps(case.refused).encode()
    threads = [
        threading.Thread(target=hammer, args=(body,), daemon=True)
        for body in [served] * case.concurrent + [refused]
    ]
    for thread in threads:
        thread.start()
    return threads


# A child that opens argv[3] connections to argv[1]:argv[2] that send nothing, prints how many
# it opened, and holds them until its stdin closes.
_HOLDER = """
import resource, socket, sys
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
held = []
try:
    for _ in range(int(sys.argv[3])):
        held.append(socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10))
except OSError:
    pass  # out of descriptors (or refused): what was opened stays open
print(len(held), flush=True)
sys.stdin.read()
"""


class IdleConnections:
    """count connections that send nothing, held by child processes: each opens what the hard
    file limit lets one process open, so 25,000 need no `ulimit -n` above it (a machine's
    hard limit is often 20,000 or less). close() ends them all."""

    def __init__(self, host: str, port: int, count: int) -> None:
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        per_child = count if hard == resource.RLIM_INFINITY else max(1, hard - 64)
        self._children: list[subprocess.Popen] = []
        self.opened = 0
        while self.opened < count:
            share = min(per_child, count - self.opened)
            child = subprocess.Popen(
                [sys.executable, "-c", _HOLDER, host, str(port), str(share)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            self._children.append(child)
            opened = int(child.stdout.readline() or 0)
            self.opened += opened
            if opened < share:
                break  # the machine or the server refuses more: stop here

    def __len__(self) -> int:
        return self.opened

    def close(self) -> None:
        for child in self._children:
            child.stdin.close()
        for child in self._children:
            child.wait(timeout=30)
        self._children = []
