"""`minivllm bench serve --goodput`: vLLM's targets and request goodput, on made-up results."""

from __future__ import annotations

import argparse

import pytest

from minivllm.bench.serve import RequestResult, _summarize, parse_goodput


def result(ttft: float, e2e: float, tokens: int, ok: bool = True) -> RequestResult:
    gaps = [(e2e - ttft) / (tokens - 1)] * (tokens - 1) if tokens > 1 else []
    return RequestResult(ok=ok, prompt_len=8, output_tokens=tokens, ttft=ttft, e2e=e2e, itl=gaps)


def summarize(results, goodput=None, duration=2.0):
    args = argparse.Namespace(request_rate=1.0, max_concurrency=None, goodput=goodput)
    return _summarize(args, results, duration)


def test_goodput_counts_completed_requests_within_every_target():
    results = [
        result(0.5, 0.5 + 9 * 0.04, 10),  # ttft 500 ms, tpot 40 ms: good
        result(0.5, 0.5 + 9 * 0.06, 10),  # tpot 60 ms: too slow
        result(1.5, 1.5 + 9 * 0.01, 10),  # ttft 1.5 s: too late
        result(0.2, 0.2, 1),  # one token: tpot 0, as vLLM counts it
        result(0.1, 0.2, 10, ok=False),  # failed: never good
    ]
    summary = summarize(results, ["ttft:1000", "tpot:50"])
    assert summary["request_goodput"] == pytest.approx(2 / 2.0)
    assert summary["goodput_targets_ms"] == {"ttft": 1000.0, "tpot": 50.0}
    assert summarize(results, ["e2el:900"])["request_goodput"] == pytest.approx(2 / 2.0)
    assert "request_goodput" not in summarize(results)


@pytest.mark.parametrize("bad", ["ttft", "latency:10", "tpot:fast", "tpot:-1"])
def test_bad_goodput_targets_are_refused(bad):
    with pytest.raises(ValueError, match="--goodput"):
        parse_goodput([bad])
