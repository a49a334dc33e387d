"""A many-model server (`minivllm serve --models-dir DIR` or `--model NAME=SOURCE`): the app's
state over a ModelRouter instead of one engine, and its start.

The routes are the one-model server's: the middleware (model_router_middleware.py) gives
each request its model's state, built as for one model. What has no model (the listing,
/health, /metrics, shutdown) sees the app state made here: every model and its status,
each loaded model's metrics merged under their model_name labels, and one lifecycle shared
by every model's handlers.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import time

import prometheus_client
from prometheus_client.metrics_core import Metric

from minivllm import envs
from minivllm.entrypoints.openai.errors import BadRequestError
from minivllm.entrypoints.openai.model_catalog import estimated_weight_bytes
from minivllm.entrypoints.openai.model_router import ModelRouter
from minivllm.entrypoints.openai.model_router_args import router_config_from
from minivllm.entrypoints.openai.protocol import ModelCard, ModelList
from minivllm.entrypoints.openai.served_model import ServedModel
from minivllm.entrypoints.openai.server_stats import STATS_TIMEOUT_S, refresh_scheduler_stats

logger = logging.getLogger(__name__)

# The nice increment of a starting engine core's imports (19 is the lowest priority).
START_IMPORT_NICE = 10


class RouterEngine:
    """What the server asks of "the engine" with no model at hand: abort requests (at
    shutdown), health, shutdown; LoRA and profiling are per model and not offered here."""

    errored = False

    def __init__(self, router: ModelRouter) -> None:
        self.router = router
        self.vllm_config = argparse.Namespace(lora_config=None)

    async def abort(self, request_ids) -> None:
        for model in self.router.loaded():
            await model.engine.abort(request_ids)

    async def check_health(self) -> None:
        """The server itself is up; each model's health is in /health's body."""

    async def start_profile(self) -> None:
        raise BadRequestError("Profiling is per model; a many-model server does not offer it.")

    stop_profile = start_profile

    def shutdown(self) -> None:
        self.router.shutdown()


class RouterModels:
    """The served names: every model of the catalog, each with its status."""

    def __init__(self, router: ModelRouter) -> None:
        self.router = router

    @property
    def names(self) -> list[str]:
        return list(self.router.models)

    @property
    def base_name(self) -> str:
        return f"{len(self.router.models)} models ({', '.join(self.router.models)})"

    def list(self) -> ModelList:
        return ModelList(data=[model_card(m) for m in self.router.models.values()])


def model_card(model: ServedModel) -> ModelCard:
    """A model's card with its status (`state`: loaded, loading, unloaded or failed) and,
    where it failed, why; its length limit once it has loaded."""
    extra = {"state": model.status_now()}
    if model.error is not None:
        extra["error"] = model.error
    if model.memory_bytes is not None:
        extra["memory_bytes"] = model.memory_bytes
    max_len = model.state.models.max_model_len if model.state is not None else None
    return ModelCard(id=model.name, root=model.source, max_model_len=max_len, **extra)


class RouterMetrics:
    """/metrics of every loaded model (each logger's own registry, its model_name label),
    merged into one family per metric name, and the router's gauge of loaded models."""

    def __init__(self, router: ModelRouter) -> None:
        self.router = router
        self.registry = prometheus_client.CollectorRegistry()
        loaded = prometheus_client.Gauge(
            "minivllm:loaded_models", "Models loaded now (engine cores running).",
            registry=self.registry,
        )  # fmt: skip
        loaded.set_function(lambda: len(router.loaded()))

    def collect(self):
        families: dict[str, Metric] = {}
        registries = [self.registry] + [
            m.state.stat_loggers.prometheus.registry for m in self.router.loaded()
        ]
        for registry in registries:
            for family in registry.collect():
                merged = families.get(family.name)
                if merged is None:
                    merged = Metric(family.name, family.documentation, family.type, family.unit)
                    families[family.name] = merged
                merged.samples.extend(family.samples)
        return list(families.values())

    def render(self) -> bytes:
        return prometheus_client.generate_latest(self)


class RouterStatsPoller:
    """Refreshes every loaded model's scheduler statistics (into its own metrics)."""

    def __init__(self, router: ModelRouter) -> None:
        self.router = router

    async def poll(self, timeout: float = STATS_TIMEOUT_S):
        states = [m.state for m in self.router.loaded()]
        await asyncio.gather(*(refresh_scheduler_stats(s) for s in states), return_exceptions=True)
        return None  # recorded per model already


def health(router: ModelRouter) -> dict:
    """/health's body: the server is up; each model's status, and the error of those down."""
    models = {}
    for model in router.models.values():
        entry = {"state": model.status_now()}
        if model.state is not None:
            entry["pid"] = model.engine.engine_core.engine_pid  # its engine core's process
        if model.is_dead():
            cause = model.engine.dead_error
            entry["error"] = f"The engine is dead: {cause.__cause__ or cause}"
        elif model.error is not None:
            entry["error"] = model.error
        models[model.name] = entry
    return {"status": "ok", "models": models}


def ollama_models(router: ModelRouter, running: bool) -> list[dict]:
    """Ollama's /api/tags entries (every model), or /api/ps's (those with an engine, and
    when their keep-alive ends)."""
    import datetime

    now = datetime.datetime.now(datetime.timezone.utc)
    entries = []
    for model in router.models.values():
        if running and model.state is None:
            continue
        fmt = "gguf" if model.source.endswith(".gguf") else "safetensors"
        entry = {
            "name": model.name,
            "model": model.name,
            "modified_at": now.isoformat(),
            # Ollama's: on disk in /api/tags, in memory (weights and KV cache) in /api/ps.
            "size": (model.memory_bytes if running else estimated_weight_bytes(model.source))
            or 0,
            "digest": "",
            "details": {"format": fmt, "family": "", "families": [], "parameter_size": "",
                        "quantization_level": ""},
        }  # fmt: skip
        if running:
            keep_alive = model.keep_alive_s
            if keep_alive is None:
                keep_alive = router.config.keep_alive_s
            idle = time.monotonic() - model.last_used
            expires = (
                "9999-12-31T23:59:59Z"
                if keep_alive is None or keep_alive == float("inf")
                else (now + datetime.timedelta(seconds=max(0.0, keep_alive - idle))).isoformat()
            )
            entry |= {"expires_at": expires, "size_vram": 0}
        entries.append(entry)
    return entries


async def init_router_state(router: ModelRouter, state, args: argparse.Namespace) -> None:
    """app.state for a many-model server (init_app_state's counterpart)."""
    await router.prepare()
    router.start()
    state.model_router = router
    state.engine = RouterEngine(router)
    state.models = RouterModels(router)
    state.stat_loggers = argparse.Namespace(prometheus=RouterMetrics(router), logging_logger=None)
    state.stats_poller = RouterStatsPoller(router)
    state.log_stats_interval = args.log_stats_interval
    state.lifecycle = router.lifecycle
    state.serving_completion = state.serving_chat = state.serving_embedding = None
    state.serving_scores = state.serving_classification = state.serving_tokenization = None


def run_many_models_server(args: argparse.Namespace, sock: socket.socket) -> None:
    """Serve the catalog's models on ``sock`` until SIGINT or SIGTERM; no model loads before
    a request (or POST /models/load) asks for it."""
    from minivllm.entrypoints.openai.api_server import serve

    # A model's engine core imports at a lower priority, so that a start takes less CPU from
    # the models serving meanwhile (envs.MINIVLLM_ENGINE_IMPORT_NICE; its children inherit it).
    envs.set_default("MINIVLLM_ENGINE_IMPORT_NICE", str(START_IMPORT_NICE))
    router = ModelRouter(router_config_from(args), args)
    logger.info("Serving %d models: %s", len(router.models),
                ", ".join(f"{m.name} ({m.source})" for m in router.models.values()))  # fmt: skip
    try:
        asyncio.run(serve(args, RouterEngine(router), sock, init_state=_init_for(router)))
    finally:
        router.shutdown()


def _init_for(router: ModelRouter):
    async def init(_engine, state, args: argparse.Namespace) -> None:
        await init_router_state(router, state, args)

    return init
