"""The flags of `minivllm serve`: vLLM's server flags, then one flag per engine argument."""

from __future__ import annotations

import argparse
import json
import os
import re
from dataclasses import MISSING, fields

from minivllm import envs
from minivllm.config import AsyncEngineArgs
from minivllm.entrypoints.openai.tool_parsers import ToolParserManager
from minivllm.platforms import DEVICES
from minivllm.reasoning import ReasoningParserManager

# Engine arguments with their help text and, where they have a fixed set, their choices.
ENGINE_ARG_HELP: dict[str, tuple[str, list[str] | None]] = {
    "model": ("The model, as the MODEL argument (which takes precedence).", None),
    "tokenizer": ("A tokenizer other than the model's: a model directory or .gguf file.", None),
    "dtype": (
        "Weights and activations dtype. auto: on a GPU bfloat16 (float16 for a float16 "
        "checkpoint or a GPU without bf16); on a CPU the checkpoint's bfloat16 where the CPU "
        "has native bf16, else float32.",
        ["auto", "float32", "float", "bfloat16", "bf16", "float16", "half"],
    ),
    "seed": ("Seed of the random sampling of requests that set none.", None),
    "max_model_len": (
        "Context length (prompt + output) per request. Default: the model's "
        "max_position_embeddings.",
        None,
    ),
    "max_num_seqs": ("Most requests running at once (one batch).", None),
    "max_num_batched_tokens": (
        "Token budget of one engine step (chunked prefill cuts longer prompts). "
        "Default: max(4096, max-num-seqs).",
        None,
    ),
    "block_size": ("Tokens per KV cache block.", None),
    "kv_cache_memory_bytes": (
        "KV cache size in bytes; accepts suffixes, e.g. 512M, 4G, 4GiB (powers of 1024). "
        "Default on CPU: MINIVLLM_CPU_KVCACHE_SPACE GiB (4 if unset); on a GPU: what "
        "--gpu-memory-utilization leaves.",
        None,
    ),
    "enable_prefix_caching": ("Reuse the KV cache of shared prompt prefixes.", None),
    "prefix_caching_hash_algo": ("Hash of the prefix cache's blocks.", ["sha256", "builtin"]),
    "kv_sharing_fast_prefill": (
        "Layers that read earlier layers' KV cache (Gemma 4's last ones) compute only the "
        "prompt rows that give logits: faster prompts, the same outputs (a step with prompt "
        "logprobs computes every row).",
        None,
    ),
    "scheduling_policy": (
        "fcfs: first come, first served; priority: by each request's `priority` "
        "(lower first), then arrival.",
        ["fcfs", "priority"],
    ),
    "device": (
        "Device to run the model on. auto: CUDA when torch sees a GPU, else the CPU.",
        list(DEVICES),
    ),
    "enforce_eager": (
        "Run every step eagerly: no graphs (on the CPU, decode steps are not replayed as "
        "kernel calls).",
        None,
    ),
    "enable_chunked_prefill": (
        "Split long prompts over several steps (on by default, as in vLLM V1). Off: each "
        "prompt is prefilled whole, and max-num-batched-tokens is raised to max-model-len.",
        None,
    ),
    "gpu_memory_utilization": (
        "Share of the GPU's memory the engine may use: the KV cache gets what is left after "
        "the weights and a profiling pass's peak (--kv-cache-memory-bytes overrides it). "
        "Accepted and unused on a CPU.",
        None,
    ),
    "trust_remote_code": (
        "Accepted for vLLM compatibility: no code from a checkpoint is ever run.",
        None,
    ),
    "swap_space": (
        "Accepted for vLLM compatibility: preempted requests are recomputed, never swapped.",
        None,
    ),
    "tensor_parallel_size": (
        "Split the model over this many worker processes (tensor parallelism); the "
        "model's attention heads must divide by it.",
        None,
    ),
    "distributed_executor_backend": (
        "How the tensor-parallel workers run: mp (processes on this machine, the default "
        "when tensor-parallel-size > 1), ray (Ray actors; joins RAY_ADDRESS's cluster or "
        "starts a local one), uni (one worker, in the engine process).",
        ["mp", "ray", "uni"],
    ),
    "enable_multiprocessing": (
        "Accepted for vLLM compatibility: the server's engine core always runs in its own process.",
        None,
    ),
    "enable_log_requests": ("Log every request as it is added and aborted.", None),
    "runner": (
        "What the model is run for. generate: completions and chat; pooling: embeddings "
        "(/v1/embeddings); auto: pooling for an embedding model's checkpoint (a bare "
        "`...Model` architecture, a GGUF file with a pooling type), else generate.",
        ["auto", "generate", "pooling"],
    ),
    "convert": (
        "How a generative architecture is adapted (vLLM's --convert). embed: pooled for "
        "embeddings (as --runner pooling); auto, none: as --runner says.",
        ["auto", "none", "embed"],
    ),
    "pooler_config": (
        "How a pooling model makes one embedding of a prompt's hidden states, as JSON: "
        '\'{"pooling_type": "LAST"|"MEAN"|"CLS", "normalize": true|false}\'. Default: what '
        "the checkpoint declares, else LAST, normalized.",
        None,
    ),
    "task": (
        "vLLM's older name for the runner: embed (or embedding) is --runner pooling, "
        "generate is --runner generate.",
        ["auto", "generate", "embed", "embedding"],
    ),
}

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """A byte count: 1073741824, 1G, 1GiB, 1GB, 0.5g, 512M (suffixes are powers of 1024)."""
    match = _SIZE.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (e.g. 4G, 512M)")
    number, unit = float(match.group(1)), match.group(2).lower()
    return int(number * 1024 ** ("kmgt".index(unit) + 1 if unit else 0))


def _json_list(text: str) -> list[str]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not a JSON list: {text!r}") from exc
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"not a JSON list of strings: {text!r}")
    return value


def parse_lora_module(text: str) -> dict:
    """vLLM's --lora-modules entry: ``name=path``, or JSON with "name", "path" and
    optionally "base_model_name"."""
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"not a JSON object: {text!r}") from exc
        if not (
            isinstance(value, dict)
            and isinstance(value.get("name"), str)
            and isinstance(value.get("path"), str)
        ):
            raise argparse.ArgumentTypeError(f'needs "name" and "path" strings: {text!r}')
        return value
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"not name=path: {text!r}")
    return {"name": name, "path": path}


def add_server_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="0.0.0.0", help="Address to listen on.")
    group.add_argument("--port", type=int, default=8000, help="Port to listen on.")
    group.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="Name(s) the model answers to in requests' `model` field; the first is the one "
        "responses carry. Default: the MODEL argument (the bundled model's file name without "
        ".gguf).",
    )
    group.add_argument(
        "--lora-modules",
        nargs="+",
        type=parse_lora_module,
        default=None,
        help="LoRA adapters served beside the model (with --enable-lora): name=path, or "
        'JSON {"name": ..., "path": ..., "base_model_name": ...}; a request picks one by '
        "naming it in its `model` field.",
    )
    group.add_argument(
        "--api-key",
        default=None,
        help="Require `Authorization: Bearer KEY` on /v1 endpoints. Default: "
        "$MINIVLLM_API_KEY, if set.",
    )
    group.add_argument(
        "--chat-template",
        default=None,
        help="Jinja chat template (a file, or the template itself) used instead of the model's.",
    )
    group.add_argument(
        "--response-role",
        default="assistant",
        help="Role of the generated message in chat responses.",
    )
    group.add_argument(
        "--max-logprobs",
        type=int,
        default=20,
        help="Most logprobs a request may ask for per token.",
    )
    group.add_argument(
        "--max-n",
        type=int,
        default=128,
        help="Most completions (`n`) one request may ask for per prompt.",
    )
    group.add_argument(
        "--max-request-body-size",
        type=parse_size,
        default=parse_size("16M"),
        help="Largest request body in bytes (suffixes as 16M, 1G); a larger one gets a 413 "
        "before it is read. 0: no limit.",
    )
    group.add_argument(
        "--shutdown-timeout",
        type=float,
        default=5.0,
        help="On SIGINT or SIGTERM, seconds the requests in flight get to finish before they "
        "are ended with an error.",
    )
    group.add_argument(
        "--allowed-origins",
        type=_json_list,
        default=["*"],
        help="CORS: allowed origins, as a JSON list.",
    )
    group.add_argument(
        "--allowed-methods", type=_json_list, default=["*"], help="CORS: allowed methods."
    )
    group.add_argument(
        "--allowed-headers", type=_json_list, default=["*"], help="CORS: allowed headers."
    )
    group.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials.")
    group.add_argument(
        "--disable-chat-page",
        action="store_true",
        help="Do not serve the browser chat page at / (for API-only deployments).",
    )
    group.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='Let the model decide when to call tools (tool_choice "auto", the default when '
        "`tools` are given); needs --tool-call-parser.",
    )
    group.add_argument(
        "--tool-call-parser",
        default=None,
        metavar="{" + ",".join(ToolParserManager.names()) + "}",
        help="How the model writes tool calls: hermes (Hermes, Qwen2.5, Qwen3), llama3_json "
        "(Llama 3.x JSON). Used with --enable-auto-tool-choice.",
    )
    group.add_argument(
        "--reasoning-parser",
        default=None,
        choices=ReasoningParserManager.names(),
        help="Move the model's <think>...</think> text into `reasoning_content` (chat); "
        "structured outputs then constrain the answer after it.",
    )
    group.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="Log level of uvicorn (the HTTP server).",
    )
    group.add_argument(
        "--disable-uvicorn-access-log",
        action="store_true",
        help="Do not log every HTTP request.",
    )
    group.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="Do not log the periodic throughput / queue / KV cache line.",
    )
    group.add_argument(
        "--log-stats-interval",
        type=float,
        default=5.0,
        help="Seconds between two statistics log lines.",
    )


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One --flag per engine argument (all of AsyncEngineArgs, with help where known)."""
    group = parser.add_argument_group("engine")
    for f in fields(AsyncEngineArgs):
        if f.name == "extra":
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not MISSING else None
        help_text, choices = ENGINE_ARG_HELP.get(f.name, (f"Engine argument {f.name}.", None))
        kind = str(f.type)
        if kind.startswith("bool"):
            group.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=default, help=help_text
            )
            continue
        if f.name == "kv_cache_memory_bytes":
            cast = parse_size
        elif kind.startswith("int"):
            cast = int
        elif kind.startswith("float"):
            cast = float
        else:
            cast = str
        group.add_argument(flag, type=cast, default=default, choices=choices, help=help_text)


def make_arg_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="A Hugging Face model directory or a .gguf file. Default: the bundled "
        "SmolLM2-135M-Instruct.",
    )
    add_server_args(parser)
    add_engine_args(parser)
    return parser


def engine_args_from(args: argparse.Namespace) -> AsyncEngineArgs:
    names = [f.name for f in fields(AsyncEngineArgs)]
    values = {name: getattr(args, name) for name in names if hasattr(args, name)}
    if args.model_tag is not None:
        values["model"] = args.model_tag
    return AsyncEngineArgs(**values)


def api_key_from(args: argparse.Namespace) -> str | None:
    return args.api_key or envs.MINIVLLM_API_KEY


def load_chat_template(value: str | None) -> str | None:
    """--chat-template: a file's content, or the value itself when it looks like a template."""
    if value is None:
        return None
    path = os.path.expanduser(value)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    if any(c in value for c in "{}\n"):
        return value
    raise ValueError(f"--chat-template: {value!r} is neither a file nor a template.")


def validate_parsed_serve_args(args: argparse.Namespace) -> None:
    """vLLM's checks of the tool and LoRA flags, with its messages (before the model
    loads)."""
    if getattr(args, "lora_modules", None) and not getattr(args, "enable_lora", False):
        raise ValueError("--lora-modules needs --enable-lora.")
    if getattr(args, "enable_auto_tool_choice", False):
        if not args.tool_call_parser:
            raise TypeError("Error: --enable-auto-tool-choice requires --tool-call-parser")
        names = ToolParserManager.names()
        if args.tool_call_parser not in names:
            raise KeyError(
                f"invalid tool call parser: {args.tool_call_parser} "
                f"(chose from {{ {','.join(names)} }})"
            )
