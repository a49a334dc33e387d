"""The router of a many-model server: one AsyncLLM (one engine core process) per loaded
model, loaded when a request names it, unloaded when idle or to make room.

Each model of the catalog is a ServedModel with a status (unloaded, loading, loaded,
dozing, failed). ``acquire`` hands a request its model's app state (the engine and the handlers,
as app_state.init_app_state builds them for one model), loading the model first if need
be: the load runs on a thread (the engine's start-up blocks) while the other models keep
serving, and the requests for it wait, at most --max-queued-per-model of them and for at
most --model-load-timeout seconds (then a 503 with Retry-After). Before a load, the least
recently used idle models are unloaded until the new one fits --max-loaded-models and
--models-memory (weights + KV cache, as each engine reports them; a model never loaded
is estimated from its files). A model whose engine core died is started again by its next
request; after --max-model-restarts failed starts or crashes in a row it stays down with
its error. A reaper task puts models idle past their keep-alive to doze (their engine
core drops its KV cache and waits; the weights stay, so the next request wakes it in well
under a second) and unloads them once they have dozed --doze-window seconds (at once with
no window).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import os
import time
from types import SimpleNamespace

from minivllm import envs
from minivllm.engine.arg_utils import AsyncEngineArgs
from minivllm.entrypoints.openai.errors import (
    BadRequestError,
    EngineUnavailableError,
    NotFoundError,
)
from minivllm.entrypoints.openai.model_catalog import estimated_weight_bytes
from minivllm.entrypoints.openai.model_router_args import GIB, RouterConfig
from minivllm.entrypoints.openai.served_model import ModelBusyError, ModelStatus, ServedModel
from minivllm.entrypoints.openai.server_lifecycle import ServerLifecycle

logger = logging.getLogger(__name__)

# How often the reaper looks for models idle past their keep-alive.
REAP_INTERVAL_S = 0.25
# How often a load waiting for room looks again for an idle model to unload.
ROOM_POLL_S = 0.05
# Retry-After of a 503 for a model still loading, or whose queue is full.
RETRY_AFTER_S = 5


class ModelRouter:
    """Owns the served models' engines; the middleware asks it for a request's model."""

    def __init__(self, config: RouterConfig, args: argparse.Namespace) -> None:
        """args: the server's flags (each model's engine arguments and handlers come from
        them, with its own source and name)."""
        self.config = config
        self.args = args
        self.models = {name: ServedModel(name, source) for name, source in config.catalog.items()}
        self.lifecycle = ServerLifecycle()  # shared by every model's handlers
        self._room = asyncio.Lock()
        self._reaper: asyncio.Task | None = None

    # ------------------------------------------------------------------ requests

    def get(self, name: str) -> ServedModel:
        model = self.models.get(name)
        if model is None:
            raise NotFoundError(
                f"The model `{name}` does not exist. Served: {', '.join(self.models)}.",
                param="model",
            )
        return model

    async def acquire(self, name: str, keep_alive_s: float | None = None) -> ServedModel:
        """The model for a request, loaded (the request must ``release`` it). Raises
        NotFoundError, ModelBusyError (503, retry), BadRequestError (it can never fit) or
        EngineUnavailableError (it failed to start)."""
        model = self.get(name)
        if keep_alive_s is not None:
            model.keep_alive_s = keep_alive_s
        model.last_used = time.monotonic()
        if model.is_dead():
            await self._drop_dead(model)
        if model.status is ModelStatus.FAILED:
            raise EngineUnavailableError(
                f"The model `{name}` is down after {model.failures} failed starts: "
                f"{model.error} (POST /models/load starts it again)."
            )
        if model.status is not ModelStatus.LOADED:  # unloaded, loading or dozing
            await self._wait_for_load(model)
        model.in_flight += 1
        model.last_used = time.monotonic()
        return model

    def release(self, model: ServedModel) -> None:
        """A request is done with its model."""
        model.in_flight -= 1
        model.last_used = time.monotonic()
        if model.status is ModelStatus.LOADED and not model.is_dead():
            model.failures = 0  # it served: earlier failures were not a crash loop
        if model.in_flight == 0 and model.keep_alive_s == 0:
            self._spawn(self.unload(model.name, "keep_alive 0"))

    async def _wait_for_load(self, model: ServedModel) -> None:
        timeout = self.config.load_timeout_s
        if model.waiting >= self.config.max_queued_per_model:
            raise ModelBusyError(
                f"The model `{model.name}` is loading and {model.waiting} requests already "
                "wait for it.",
                RETRY_AFTER_S,
            )
        model.waiting += 1
        try:
            task = self._start_load(model)
            await asyncio.wait_for(asyncio.shield(task), timeout)
        except asyncio.TimeoutError:
            raise ModelBusyError(
                f"The model `{model.name}` is still loading after {timeout:g} s.", RETRY_AFTER_S
            ) from None
        finally:
            model.waiting -= 1

    async def prepare(self) -> None:
        """Read each local model's config and build its tokenizer, before the server takes
        requests. Building a tokenizer holds the GIL for a third of a second or more
        (transformers parses tokenizer.json in one call): done at a model's first start, it
        would delay every loaded model's requests that long. A model that fails here is left
        to its first start, which reports why."""
        started = time.monotonic()
        prepared = await asyncio.to_thread(
            lambda: sum(self._prepare(m) for m in self.models.values())
        )
        logger.info("Read %d models' configs and tokenizers in %.1f s", prepared,
                    time.monotonic() - started)  # fmt: skip

    def _prepare(self, model: ServedModel) -> bool:
        from minivllm.engine.create_config import create_vllm_config
        from minivllm.tokenizer import load_tokenizer

        if not os.path.exists(os.path.expanduser(model.source)):
            return False  # a Hub or Ollama name: resolved (downloaded) at its first start
        try:
            config = create_vllm_config(self._engine_args(model))
            model.model_config = config.model_config
            model.tokenizer = load_tokenizer(config.model_config.tokenizer)
        except Exception as exc:
            logger.warning("Model %s: could not read its config or tokenizer: %s", model.name,
                           exc)  # fmt: skip
            return False
        return True

    async def describe(self, name: str) -> dict:
        """Ollama's /api/show answer for a model not loaded: from its config (built once on a
        thread: the model's files' metadata), without starting its engine core."""
        from minivllm.engine.create_config import create_vllm_config
        from minivllm.entrypoints.openai.cli_args import load_chat_template
        from minivllm.entrypoints.openai.routes.ollama import show_body

        model = self.get(name)
        if model.model_config is None:
            try:
                config = await asyncio.to_thread(create_vllm_config, self._engine_args(model))
            except Exception as exc:
                raise BadRequestError(f"The model `{name}` cannot be read: {exc}") from None
            model.model_config = config.model_config
        config = model.model_config
        capabilities = ["embedding"] if config.runner_type == "pooling" else ["completion"]
        if config.runner_type != "pooling" and getattr(self.args, "tool_call_parser", None):
            capabilities.append("tools")
        if config.runner_type != "pooling" and await asyncio.to_thread(_fills_in, config):
            capabilities.append("insert")  # Ollama's name for fill in the middle
        template = load_chat_template(getattr(self.args, "chat_template", None))
        return show_body(config, capabilities, template)

    # ------------------------------------------------------------------ load and unload

    def _start_load(self, model: ServedModel) -> asyncio.Task:
        """The task that loads the model (or wakes it from its doze), started if need be."""
        if model.load_task is None or model.load_task.done():
            if model.status is ModelStatus.DOZING:
                model.load_task = asyncio.ensure_future(self._wake(model))
            else:
                model.status = ModelStatus.LOADING
                model.load_task = asyncio.ensure_future(self._load(model))
            # Its error reaches its waiters; one nobody waits for any more is only logged.
            model.load_task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return model.load_task

    async def load(self, name: str) -> ServedModel:
        """Load a model now (POST /models/load); one that is down gets its chances again."""
        model = self.get(name)
        if model.status is ModelStatus.FAILED:
            model.status, model.failures = ModelStatus.UNLOADED, 0
        model.last_used = time.monotonic()
        if model.is_dead():
            await self._drop_dead(model)
        if model.status is not ModelStatus.LOADED:
            await asyncio.shield(self._start_load(model))
        return model

    async def _load(self, model: ServedModel) -> None:
        from minivllm.entrypoints.openai.app_state import init_app_state

        try:
            await self._make_room(model, self._expected_bytes(model))
            started = time.monotonic()
            logger.info("Loading model %s from %s", model.name, model.source)
            engine = await asyncio.to_thread(self._start_engine, model)
        except OpenAIServingErrorTypes:
            model.status, model.reserved_bytes = ModelStatus.UNLOADED, 0
            raise
        except Exception as exc:
            self._failed(model, exc)
            raise EngineUnavailableError(
                f"The model `{model.name}` failed to start: {model.error}"
            ) from None
        used = None
        try:
            state = SimpleNamespace(lifecycle=self.lifecycle)
            await init_app_state(engine, state, self._model_args(model))
            used = _engine_memory_bytes(engine)
            budget = self.config.memory_bytes
            if budget is not None and used > budget:
                raise BadRequestError(
                    f"The model `{model.name}` needs {used / GIB:.2f} GiB (weights "
                    f"{engine.engine_core.weight_memory_bytes / GIB:.2f} GiB + KV cache), "
                    f"more than --models-memory {budget / GIB:.2f} GiB."
                )
        except BaseException as exc:
            await _shutdown_engine(engine)
            if isinstance(exc, OpenAIServingErrorTypes):
                model.memory_bytes = used if isinstance(exc, BadRequestError) else None
                model.status, model.reserved_bytes = ModelStatus.UNLOADED, 0
                raise
            self._failed(model, exc)
            raise EngineUnavailableError(
                f"The model `{model.name}` failed to start: {model.error}"
            ) from None
        model.state, model.memory_bytes, model.reserved_bytes = state, used, used
        model.kv_bytes = int(engine.vllm_config.cache_config.kv_cache_memory_bytes or 0)
        model.status, model.error = ModelStatus.LOADED, None
        model.last_used = time.monotonic()
        logger.info("Model %s loaded in %.1f s (%.2f GiB)", model.name,
                    time.monotonic() - started, used / GIB)  # fmt: skip

    def _start_engine(self, model: ServedModel):
        """The model's AsyncLLM (on a thread: it waits for the core to load), with the
        tokenizer built at the server's start or at its last load (``prepare`` says why)."""
        from minivllm.engine.async_llm import AsyncLLM
        from minivllm.engine.frontend import config_with_core

        args = self._engine_args(model)
        config, core = config_with_core(args, None, asyncio_mode=True)
        engine = AsyncLLM(
            config,
            tokenizer=model.tokenizer,
            log_requests=args.enable_log_requests,
            engine_core=core,
        )
        model.tokenizer = engine.tokenizer
        return engine

    def _failed(self, model: ServedModel, exc: BaseException) -> None:
        model.failures += 1
        model.error = f"{type(exc).__name__}: {exc}"
        model.reserved_bytes = 0
        down = model.failures >= self.config.max_restarts
        model.status = ModelStatus.FAILED if down else ModelStatus.UNLOADED
        logger.error("Model %s failed to start (%d in a row%s): %s", model.name, model.failures,
                     ", it stays down" if down else "", model.error)  # fmt: skip

    async def _drop_dead(self, model: ServedModel) -> None:
        """A loaded model whose engine core died: counted as a failure and unloaded, so that
        its next load starts a new core (unless it keeps failing)."""
        cause = model.engine.dead_error
        state = self._detach(model, "its engine core died")
        self._failed(model, cause.__cause__ or cause)
        await _shutdown_engine(state.engine)

    async def _doze(self, model: ServedModel) -> None:
        """Drop an idle model's KV cache; its weights stay loaded."""
        model.status, model.dozed_at = ModelStatus.DOZING, time.monotonic()
        try:
            freed = await model.engine.sleep()
        except Exception as exc:  # a request came meanwhile, or the core died
            if model.status is ModelStatus.DOZING:
                model.status = ModelStatus.LOADED
            logger.info("Model %s did not doze: %s", model.name, exc)
            return
        if model.status is ModelStatus.DOZING and not model.changing():
            model.reserved_bytes = max(0, (model.memory_bytes or 0) - model.kv_bytes)
        logger.info("Model %s dozes (KV cache dropped, %.2f GiB let go)", model.name,
                    freed / GIB)  # fmt: skip

    async def _wake(self, model: ServedModel) -> None:
        """Bind a dozing model's KV cache again, after making room for it."""
        started = time.monotonic()
        await self._make_room(model, model.memory_bytes or 0)
        try:
            await model.engine.wake_up()
        finally:
            if model.status is ModelStatus.DOZING:
                model.status = ModelStatus.LOADED  # dead, if it failed: its request sees it
        logger.info("Model %s woke in %.3f s", model.name, time.monotonic() - started)

    async def unload(self, name: str, reason: str = "asked") -> bool:
        """Stop a model's engine core (its requests in flight end with an error). False
        when it was not loaded."""
        model = self.get(name)
        if model.state is None or model.status not in (ModelStatus.LOADED, ModelStatus.DOZING):
            return False
        await _shutdown_engine(self._detach(model, reason).engine)
        return True

    def _detach(self, model: ServedModel, reason: str) -> SimpleNamespace:
        """Mark a model unloaded (at once: no request gets it any more); returns the state
        whose engine is to be stopped."""
        state, model.state = model.state, None
        model.status, model.reserved_bytes = ModelStatus.UNLOADED, 0
        model.keep_alive_s = None
        logger.info("Unloading model %s (%s)", model.name, reason)
        return state

    def _expected_bytes(self, model: ServedModel) -> int:
        """A model's weights and KV cache: as its engine reported at its last load, or its
        weight files on disk and the KV cache the engine arguments give it."""
        if model.memory_bytes is not None:
            return model.memory_bytes
        kv = getattr(self.args, "kv_cache_memory_bytes", None)
        if kv is None:
            kv = int(envs.MINIVLLM_CPU_KVCACHE_SPACE * GIB)
        return estimated_weight_bytes(model.source) + kv

    async def _make_room(self, model: ServedModel, needed: int) -> None:
        """Unload least recently used idle models until ``model`` fits the limits with
        ``needed`` bytes, then reserve them. BadRequestError where it never can;
        ModelBusyError where the others stay busy past the load timeout."""
        budget = self.config.memory_bytes
        if budget is not None and needed > budget:
            raise BadRequestError(
                f"The model `{model.name}` needs about {needed / GIB:.2f} GiB (weights and KV "
                f"cache), more than --models-memory {budget / GIB:.2f} GiB: it can never load."
            )
        deadline = time.monotonic() + self.config.load_timeout_s
        async with self._room:
            while True:
                others = [
                    m for m in self.models.values() if m is not model and m.status in _HOLDING
                ]
                fits_count = (
                    self.config.max_loaded_models is None
                    or len(others) < self.config.max_loaded_models
                )
                used = sum(m.reserved_bytes for m in others)
                if fits_count and (budget is None or used + needed <= budget):
                    model.reserved_bytes = needed
                    return
                idle = [m for m in others if m.state is not None and not m.in_flight]
                if idle:
                    victim = min(idle, key=lambda m: m.last_used)
                    await self.unload(victim.name, f"to make room for {model.name}")
                    continue
                if time.monotonic() > deadline:
                    busy = ", ".join(m.name for m in others)
                    raise ModelBusyError(
                        f"No room to load `{model.name}`: the loaded models ({busy}) stay busy.",
                        RETRY_AFTER_S,
                    )
                await asyncio.sleep(ROOM_POLL_S)

    def _engine_args(self, model: ServedModel) -> AsyncEngineArgs:
        from minivllm.entrypoints.openai.cli_args import engine_args_from

        base = engine_args_from(argparse.Namespace(**{**vars(self.args), "model_tag": None}))
        return dataclasses.replace(base, model=model.source)

    def _model_args(self, model: ServedModel) -> argparse.Namespace:
        """The server's flags as one model's handlers see them: served under its name; the
        periodic log line is the router's."""
        return argparse.Namespace(
            **{
                **vars(self.args),
                "served_model_name": [model.name],
                "model_tag": None,
                "disable_log_stats": True,
            }
        )

    # ------------------------------------------------------------------ idle and shutdown

    def start(self) -> None:
        """Start the reaper (in the server's event loop)."""
        if self._reaper is None:
            self._reaper = asyncio.ensure_future(self._reap_forever())

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(REAP_INTERVAL_S)
            now = time.monotonic()
            for model in list(self.models.values()):
                keep_alive = model.keep_alive_s
                if keep_alive is None:
                    keep_alive = self.config.keep_alive_s
                if model.in_flight or model.is_dead() or model.changing():
                    continue  # a dead one waits for its next request, which restarts it
                try:
                    if model.status is ModelStatus.DOZING:
                        if now - model.dozed_at >= self.config.doze_window_s:
                            await self.unload(model.name, "dozed its window out")
                    elif (
                        keep_alive is not None
                        and model.status is ModelStatus.LOADED
                        and now - model.last_used >= keep_alive
                    ):
                        if self.config.doze_window_s > 0 and keep_alive > 0:
                            await self._doze(model)
                        else:
                            await self.unload(model.name, f"idle for {keep_alive:g} s")
                except Exception:
                    logger.exception("Could not doze or unload model %s", model.name)

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())

    def loaded(self) -> list[ServedModel]:
        """The models with an engine core (loaded or dozing)."""
        return [m for m in self.models.values() if m.state is not None]

    def shutdown(self) -> None:
        """Stop every engine core (the server is exiting; its event loop may be closed)."""
        if self._reaper is not None:
            self._reaper.cancel()
        engines = [self._detach(m, "the server exits").engine for m in self.loaded()]
        # Each core gets its SHUTDOWN and its grace at once, not one after the other.
        with concurrent.futures.ThreadPoolExecutor(max(1, len(engines))) as pool:
            list(pool.map(lambda engine: engine.engine_core.shutdown(), engines))
        for engine in engines:
            engine.shutdown()


OpenAIServingErrorTypes = (BadRequestError, ModelBusyError, NotFoundError)
# The statuses that hold memory (and count against --max-loaded-models).
_HOLDING = (ModelStatus.LOADING, ModelStatus.LOADED, ModelStatus.DOZING)


def _engine_memory_bytes(engine) -> int:
    """The weights and the KV cache of a loaded engine, as its core reported them."""
    weights = int(engine.engine_core.weight_memory_bytes or 0)
    kv = engine.vllm_config.cache_config.kv_cache_memory_bytes or 0
    return weights + int(kv)


async def _shutdown_engine(engine) -> None:
    """Stop an engine's core process on a thread (it waits for the process to exit), then
    its output handler here."""
    await asyncio.to_thread(engine.engine_core.shutdown)
    engine.shutdown()


@functools.lru_cache(maxsize=64)
def _fills_in_tokenizer(path: str) -> bool:
    from minivllm.entrypoints.openai.fill_in_middle import FillInMiddle
    from minivllm.tokenizer import load_tokenizer

    return FillInMiddle.of(load_tokenizer(path)) is not None


def _fills_in(config) -> bool:
    """Whether the model's tokenizer has FIM tokens (read once a tokenizer; a GGUF's is
    cached on disk after the first read)."""
    try:
        return _fills_in_tokenizer(config.tokenizer)
    except Exception:  # a tokenizer that cannot be read: the model's load will say why
        return False
