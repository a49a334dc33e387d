"""`minivllm bench ...`: throughput, latency, serve and startup benchmarks with vLLM's flags."""

from __future__ import annotations

import argparse

from minivllm.bench import latency, serve, startup, throughput

BENCHMARKS = {
    "throughput": throughput,
    "latency": latency,
    "serve": serve,
    "startup": startup,
}


def register(subparsers) -> None:
    """Add `bench <name>` to a CLI's subparsers."""
    bench = subparsers.add_parser("bench", help="run a benchmark")
    kinds = bench.add_subparsers(dest="bench_name", required=True)
    for name, module in BENCHMARKS.items():
        sub = kinds.add_parser(name, help=(module.__doc__ or "").strip().splitlines()[0])
        module.add_cli_args(sub)
        sub.set_defaults(dispatch=module.main)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="minivllm")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    args.dispatch(args)
