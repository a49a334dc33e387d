"""Argument helpers shared by the offline benchmarks (vLLM's flag names)."""

from __future__ import annotations

import argparse
import json
from dataclasses import fields

from minivllm.config import EngineArgs
from minivllm.platforms import DEVICES, get_platform


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model dir or .gguf (default: bundled)")
    parser.add_argument("--device", default="auto", choices=DEVICES)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument(
        "--quantization",
        default=None,
        choices=["gguf", "mxfp4", "none"],
        help="GGUF (or MXFP4) blocks: keep them or not",
    )
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True
    )
    parser.add_argument(
        "--kv-sharing-fast-prefill", action=argparse.BooleanOptionalAction, default=False
    )
    parser.add_argument("--seed", type=int, default=0)


def engine_kwargs(args: argparse.Namespace) -> dict:
    names = {f.name for f in fields(EngineArgs)}
    return {k: v for k, v in vars(args).items() if k in names and k != "model"}


def print_header(title: str, device: str) -> str:
    """vLLM's result banner, then the model name of the device (``device``: "cpu" or
    "cuda", as the engine resolved it) that the figures below come from."""
    name = get_platform(device).device_name()
    print("{s:{c}^50}".format(s=f" {title} ", c="="))
    print(f"{'Device:':<40}{name}")
    return name


def write_json(path: str | None, results: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=2)
