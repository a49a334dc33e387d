"""Argument helpers shared by the offline benchmarks (vLLM's flag names)."""

from __future__ import annotations

import argparse
import json
from dataclasses import fields

from minivllm.engine.arg_utils import EngineArgs
from minivllm.platforms import get_platform

# The engine flags of the offline benchmarks (vLLM's names; the others keep their defaults).
BENCH_ENGINE_ARGS = (
    "model",
    "device",
    "dtype",
    "quantization",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "block_size",
    "kv_cache_memory_bytes",
    "kv_cache_dtype",
    "gpu_memory_utilization",
    "enable_prefix_caching",
    "kv_sharing_fast_prefill",
    "seed",
)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(parser, only=BENCH_ENGINE_ARGS)


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
