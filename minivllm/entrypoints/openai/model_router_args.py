"""The flags of a many-model server (--models-dir, --model NAME=SOURCE, its memory and idle
limits) and what they say as one RouterConfig."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from minivllm.entrypoints.openai.model_catalog import model_catalog, parse_model_spec

GIB = 1 << 30


class ModelFlag(argparse.Action):
    """--model: one model (vLLM's flag, stored as `model`), or NAME=SOURCE, repeatable,
    appended to `model_specs` (a many-model server)."""

    def __call__(self, parser, namespace, value, option_string=None) -> None:
        try:
            spec = parse_model_spec(value)
        except ValueError as exc:
            raise argparse.ArgumentError(self, str(exc)) from None
        if spec is None:
            setattr(namespace, self.dest, value)
        else:
            specs = list(getattr(namespace, "model_specs", None) or [])
            namespace.model_specs = [*specs, spec]


def add_model_router_args(group) -> None:
    group.add_argument(
        "--models-dir",
        default=None,
        help="Serve every GGUF file and Hugging Face model folder below this folder, each "
        "under its file stem or folder name, loaded when a request names it in `model` "
        "(llama.cpp's router mode). --model NAME=SOURCE (repeatable; SOURCE as for MODEL) "
        "serves one more by name, with or without --models-dir.",
    )
    group.add_argument(
        "--max-loaded-models",
        type=int,
        default=None,
        help="Most models loaded at once (Ollama's OLLAMA_MAX_LOADED_MODELS); loading "
        "another unloads the least recently used idle one. Default: no limit.",
    )
    group.add_argument(
        "--models-memory",
        type=float,
        default=None,
        metavar="GIB",
        help="Memory the loaded models may hold together, in GiB: weights plus KV cache, as "
        "each engine core reports them; loading one that does not fit unloads the least "
        "recently used idle ones first. Default: no limit.",
    )
    group.add_argument(
        "--keep-alive",
        type=float,
        default=None,
        metavar="SECONDS",
        help="After this many seconds without requests a model dozes (its KV cache is "
        "dropped, its weights stay: the next request wakes it in well under a second), then "
        "is unloaded after --doze-window (Ollama's keep_alive; an Ollama request's own "
        "keep_alive overrides it for its model). Default: never.",
    )
    group.add_argument(
        "--doze-window",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="How long a model idle past its keep-alive dozes before it is unloaded; 0: "
        "unloaded at once.",
    )
    group.add_argument(
        "--model-load-timeout",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="How long a request waits for its model to load before a 503 with Retry-After.",
    )
    group.add_argument(
        "--max-queued-per-model",
        type=int,
        default=64,
        help="Requests that may wait for one model to load; more get a 503 with Retry-After.",
    )
    group.add_argument(
        "--max-model-restarts",
        type=int,
        default=3,
        help="Failed starts or crashes in a row (no request served between them) after which "
        "a model stays down (its error is kept and answered) until it is loaded again with "
        "POST /models/load.",
    )


@dataclass
class RouterConfig:
    """What a many-model server's flags say."""

    catalog: dict[str, str]  # name -> source
    max_loaded_models: int | None = None
    memory_bytes: int | None = None
    keep_alive_s: float | None = None
    doze_window_s: float = 60.0
    load_timeout_s: float = 120.0
    max_queued_per_model: int = 64
    max_restarts: int = 3


def is_many_models(args: argparse.Namespace) -> bool:
    """Whether the flags ask for a many-model server (--models-dir or --model NAME=SOURCE)."""
    return bool(getattr(args, "models_dir", None) or getattr(args, "model_specs", None))


def router_config_from(args: argparse.Namespace) -> RouterConfig:
    if args.model_tag is not None:
        raise ValueError("MODEL cannot be given with --models-dir or --model NAME=SOURCE.")
    if args.served_model_name:
        raise ValueError("--served-model-name names one model; with many, name each with "
                         "--model NAME=SOURCE.")  # fmt: skip
    if getattr(args, "lora_modules", None):
        raise ValueError("--lora-modules adapt one base model; a many-model server does not "
                         "take them (serve the adapters from a one-model server).")  # fmt: skip
    for flag, value in (
        ("--max-loaded-models", args.max_loaded_models),
        ("--models-memory", args.models_memory),
        ("--model-load-timeout", args.model_load_timeout),
        ("--max-queued-per-model", args.max_queued_per_model),
    ):
        if value is not None and value <= 0:
            raise ValueError(f"{flag} must be positive, got {value}.")
    return RouterConfig(
        catalog=model_catalog(args.models_dir, getattr(args, "model_specs", None) or []),
        max_loaded_models=args.max_loaded_models,
        memory_bytes=int(args.models_memory * GIB) if args.models_memory else None,
        keep_alive_s=args.keep_alive if args.keep_alive is None or args.keep_alive >= 0 else None,
        doze_window_s=max(0.0, args.doze_window),
        load_timeout_s=args.model_load_timeout,
        max_queued_per_model=args.max_queued_per_model,
        max_restarts=max(1, args.max_model_restarts),
    )
