"""`minivllm bench serve` against the real server (here, where the server fixture lives)."""

from __future__ import annotations

import argparse
import json

from minivllm.bench import serve


def bench_args(server, tmp_path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_cli_args(parser)
    argv = ["--base-url", server.url_root]
    argv += ["--num-prompts", "8", "--random-input-len", "16", "--random-output-len", "8"]
    argv += ["--output-json", str(tmp_path / "result.json"), *extra]
    return parser.parse_args(argv)


def test_bench_serve_reports_every_request(server, tmp_path):
    args = bench_args(server, tmp_path, "--request-rate", "20", "--max-concurrency", "4")
    summary = serve.main(args)
    assert summary["completed"] == 8 and summary["failed"] == 0
    assert summary["total_input_tokens"] == 8 * 16
    assert summary["total_output_tokens"] == 8 * 8  # ignore_eos: every token asked for
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < summary[f"median_{name}_ms"] <= summary[f"p99_{name}_ms"]
    assert summary["median_ttft_ms"] < summary["median_e2el_ms"]
    assert json.loads((tmp_path / "result.json").read_text())["completed"] == 8


def test_bench_serve_counts_failed_requests_instead_of_crashing(server, tmp_path):
    args = bench_args(server, tmp_path, "--endpoint", "/v1/no-such-endpoint")
    summary = serve.main(args)
    assert summary["completed"] == 0 and summary["failed"] == 8
    assert "HTTP 404" in summary["errors"][0]
