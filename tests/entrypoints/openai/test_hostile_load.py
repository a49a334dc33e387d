"""Issue 47's hostile requests that the bounds still serve (hostile_cases.py), each against a
real server while /health is polled and small requests are sent one after another: the
hostile request is served (200), /health keeps answering, and the small requests' first
tokens are not held behind it. The bounds are loose (a loaded two-core test machine);
benchmarks/hostile_timing.py measures the issue's (100 ms, 1 s, 2x idle) on a quiet one.
With 512 sequences a request allowed, a small request's first token waited 12-15 s."""

from __future__ import annotations

import dataclasses
import statistics

import pytest

from benchmarks.hostile_timing import served_load, ttft
from tests.entrypoints.openai.hostile_cases import BY_NAME, SERVER_ARGS
from tests.entrypoints.openai.utils import RemoteServer

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

HEALTH_MAX_S = 2.0
PROBE_TTFT_MAX_S = 3.0


@pytest.fixture(scope="module")
def loaded_server():
    server = RemoteServer([*SERVER_ARGS, "--max-model-len", "1024"])
    for _ in range(3):  # warm-up
        ttft(server)
    yield server, statistics.median(ttft(server) for _ in range(5))
    server.stop()


@pytest.mark.parametrize("name", list(BY_NAME))
def test_a_served_hostile_request_leaves_health_and_others_answering(loaded_server, name):
    server, idle_ttft = loaded_server
    case = BY_NAME[name]
    if case.concurrent > 1:  # the 32 copies take a minute here: 4 show the same
        case = dataclasses.replace(case, concurrent=4)
    result = served_load(server, case, idle_ttft)
    print(name, {k: result[k] for k in ("health_max_s", "probe_ttft_median_s", "probes")})
    assert result["served_statuses"] == [200], result
    assert result["health_max_s"] < HEALTH_MAX_S, result
    assert result["probe_ttft_median_s"] < PROBE_TTFT_MAX_S, result
