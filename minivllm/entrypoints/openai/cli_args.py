"""The flags of `minivllm serve`: vLLM's server flags, then one flag per engine argument."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import fields

from minivllm import envs
from minivllm.engine.arg_utils import AsyncEngineArgs, parse_size
from minivllm.entrypoints.openai.model_router_args import ModelFlag, add_model_router_args
from minivllm.entrypoints.openai.security_args import add_security_args
from minivllm.entrypoints.openai.tool_parsers import ToolParserManager
from minivllm.reasoning import ReasoningParserManager


def _json_list(text: str) -> list[str]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not a JSON list: {text!r}") from exc
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"not a JSON list of strings: {text!r}")
    return value


def _template_kwargs(text: str) -> dict:
    """--default-chat-template-kwargs: a JSON object, without the keys the server sets."""
    from minivllm.entrypoints.openai.prompt_tokenization import RESERVED_TEMPLATE_KWARGS

    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r}")
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & value.keys())
    if reserved:
        raise argparse.ArgumentTypeError(f"the server sets {', '.join(reserved)} itself")
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
        "--default-chat-template-kwargs",
        type=_template_kwargs,
        default=None,
        help="The chat template's keyword arguments for every request, as JSON (e.g. "
        "'{\"enable_thinking\": false}' for Qwen3); a request's chat_template_kwargs win.",
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
        default=[],
        help='CORS: allowed origins, as a JSON list (["*"]: any). Default: none, CORS off (the '
        "chat page is same-origin).",
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
        "--disable-fastapi-docs",
        action="store_true",
        help="Do not serve /docs, /redoc and /openapi.json.",
    )
    group.add_argument(
        "--root-path",
        default="",
        help="The path prefix a reverse proxy serves the API under (uvicorn's root_path).",
    )
    group.add_argument("--ssl-keyfile", default=None, help="HTTPS: the server's private key.")
    group.add_argument("--ssl-certfile", default=None, help="HTTPS: the server's certificate.")
    group.add_argument(
        "--enable-force-include-usage",
        action="store_true",
        help="End every stream with a usage chunk, as if it asked for stream_options "
        "include_usage.",
    )
    group.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help='Name tokens in logprobs as "token_id:N" for every request (the request '
        "field of that name, on by default).",
    )
    group.add_argument(
        "--enable-request-id-headers",
        action="store_true",
        help="Answer each request with an X-Request-Id header: its own, or a new id.",
    )
    group.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="vLLM's older flag, accepted for its command lines: requests are logged only "
        "with --enable-log-requests.",
    )
    group.add_argument(
        "--enable-tokenizer-info-endpoint",
        action="store_true",
        help="Serve GET /tokenizer_info: the tokenizer's configuration and chat template (for "
        "clients with no local tokenizer, as lm-eval's remote tokenizer). Off by default: it "
        "shows the chat template and tokenizer settings to any client.",
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
    add_security_args(group)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One --flag per engine argument (all of AsyncEngineArgs), in an "engine" group; --model
    also takes NAME=SOURCE, repeatable (a many-model server)."""
    group = parser.add_argument_group("engine")
    model = next(f for f in fields(AsyncEngineArgs) if f.name == "model")
    group.add_argument(
        "--model",
        action=ModelFlag,
        type=str,
        default=model.default,
        # Its help is the field's (NAME=SOURCE is told by --models-dir's, with the others).
        help=model.metadata["help"],
    )
    parser.set_defaults(model_specs=None)
    AsyncEngineArgs.add_cli_args(
        group, only=[f.name for f in fields(AsyncEngineArgs) if f.name != "model"]
    )


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
    add_model_router_args(parser.add_argument_group("many models"))
    add_engine_args(parser)
    return parser


def engine_args_from(args: argparse.Namespace) -> AsyncEngineArgs:
    engine_args = AsyncEngineArgs.from_cli_args(args)
    if args.model_tag is not None:
        engine_args.model = args.model_tag
    return engine_args


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
