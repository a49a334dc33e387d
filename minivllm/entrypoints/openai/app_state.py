"""The app's state: the engine, the served names, the stat loggers and one handler per API
that the model's runner serves (the routes find them on app.state)."""

from __future__ import annotations

import argparse
import os

import prometheus_client

from minivllm.entrypoints.openai.cli_args import load_chat_template
from minivllm.entrypoints.openai.server_lifecycle import ServerLifecycle
from minivllm.entrypoints.openai.server_stats import SchedulerStatsPoller
from minivllm.entrypoints.openai.serving_chat import OpenAIServingChat
from minivllm.entrypoints.openai.serving_classification import OpenAIServingClassification
from minivllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from minivllm.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from minivllm.entrypoints.openai.serving_models import ServedModels
from minivllm.entrypoints.openai.serving_score import OpenAIServingScores
from minivllm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from minivllm.lora.request import LoRARequest
from minivllm.metrics.loggers import LoggingStatLogger, PrometheusStatLogger, StatLoggerManager


def default_served_name(args: argparse.Namespace, model_path: str) -> str:
    """The MODEL argument as given; for the bundled model, its file name without .gguf."""
    given = args.model_tag or getattr(args, "model", None)
    if given:
        return given
    name = os.path.basename(model_path.rstrip("/"))
    return name.removesuffix(".gguf")


async def load_lora_modules(args: argparse.Namespace, engine) -> list[LoRARequest]:
    """--lora-modules as LoRARequests (ids from 1, in order), each read and checked by the
    engine now: a bad adapter stops the start-up, not its first request."""
    loras = []
    for i, module in enumerate(getattr(args, "lora_modules", None) or [], start=1):
        lora = LoRARequest(module["name"], i, module["path"], module.get("base_model_name"))
        try:
            await engine.add_lora(lora)
        except ValueError as exc:
            raise ValueError(f"--lora-modules {lora.lora_name}: {exc}") from None
        loras.append(lora)
    return loras


async def init_app_state(engine, state, args: argparse.Namespace) -> None:
    model_config = engine.model_config
    tokenizer = await engine.get_tokenizer()
    names = args.served_model_name or [default_served_name(args, model_config.model)]
    models = ServedModels(
        names, model_config.model, model_config.max_model_len, await load_lora_modules(args, engine)
    )
    cache_config = engine.vllm_config.cache_config
    registry = prometheus_client.CollectorRegistry()  # one per server, every engine core's
    prometheus = [
        PrometheusStatLogger(
            names[0],
            model_config.max_model_len,
            engine_index=engine_index,
            cache_info={
                "block_size": str(cache_config.block_size),
                "enable_prefix_caching": str(cache_config.enable_prefix_caching),
                "num_gpu_blocks": str(getattr(engine.engine_core, "num_blocks", None)),
            },
            registry=registry,
            max_loras=lora_config.max_loras
            if (lora_config := engine.vllm_config.lora_config)
            else None,
        )
        for engine_index in range(engine.vllm_config.parallel_config.data_parallel_size)
    ]
    logging_logger = (
        None if args.disable_log_stats else LoggingStatLogger(device=engine.vllm_config.device)
    )
    state.engine = engine
    state.models = models
    state.stat_loggers = StatLoggerManager(prometheus, logging_logger)
    engine.add_stat_logger(state.stat_loggers)  # the engine records; /metrics exports
    state.stats_poller = SchedulerStatsPoller(engine)
    state.log_stats_interval = args.log_stats_interval
    # A many-model server's models share one lifecycle (set before), so shutdown sees all.
    state.lifecycle = getattr(state, "lifecycle", None) or ServerLifecycle()
    common = dict(
        engine=engine,
        tokenizer=tokenizer,
        models=models,
        max_logprobs=args.max_logprobs,
        chat_template=load_chat_template(args.chat_template),
        max_n=args.max_n,
        lifecycle=state.lifecycle,
        default_sampling_params=model_config.get_diff_sampling_param(),
        content_as_text=getattr(args, "tokenize_content_as_text", False),
        default_chat_template_kwargs=getattr(args, "default_chat_template_kwargs", None),
        force_include_usage=getattr(args, "enable_force_include_usage", False),
        return_tokens_as_token_ids=getattr(args, "return_tokens_as_token_ids", False),
    )
    # The runner decides the APIs: a pooling model serves embeddings, a generative one
    # completions and chat; the other routes answer that the model does not support them.
    state.serving_completion = state.serving_chat = state.serving_embedding = None
    state.serving_scores = state.serving_classification = None
    if model_config.runner_type == "pooling" and model_config.pooling_task == "classify":
        state.serving_classification = OpenAIServingClassification(
            **common, model_config=model_config
        )
        # A classifier scores text pairs as a cross-encoder (one label only, per request).
        state.serving_scores = OpenAIServingScores(**common, model_config=model_config)
    elif model_config.runner_type == "pooling":
        state.serving_embedding = OpenAIServingEmbedding(**common, model_config=model_config)
        state.serving_scores = OpenAIServingScores(**common, model_config=model_config)
    else:
        state.serving_completion = OpenAIServingCompletion(**common)
        state.serving_chat = OpenAIServingChat(
            **common,
            response_role=args.response_role,
            enable_auto_tools=getattr(args, "enable_auto_tool_choice", False),
            tool_parser=getattr(args, "tool_call_parser", None),
            reasoning_parser=getattr(args, "reasoning_parser", None),
        )
    state.serving_tokenization = OpenAIServingTokenization(**common)
