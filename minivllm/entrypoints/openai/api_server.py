"""The OpenAI-compatible server: FastAPI routes over one AsyncLLM, run by uvicorn.

Routes: /v1/completions and /v1/chat/completions (a generative model), /v1/embeddings,
/score and /rerank (a pooling model, --runner pooling: an embedding model or a cross-encoder;
also under /v1, /rerank under /v2), /classify (a sequence classifier), /v1/models[/{id}],
/tokenize, /detokenize, /health, /ping, /version, /metrics, the chat page at / (unless
--disable-chat-page), and /start_profile, /stop_profile while a profiler folder is set. Errors
are OpenAI-style JSON bodies. A request whose client disconnects is cancelled, which aborts it
in the engine. A body over
--max-request-body-size is refused with a 413 before it is read whole. On SIGINT or SIGTERM
the server stops accepting, gives the requests in flight --shutdown-timeout seconds, then
ends them with an error (streams: an error event, then [DONE]) and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import secrets
import signal
import socket
import sys
from http import HTTPStatus

import prometheus_client
import pydantic
import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

import minivllm
from minivllm import envs
from minivllm.engine.core_client import AsyncMPClient
from minivllm.engine.exceptions import EngineDeadError
from minivllm.entrypoints.openai.chat_page import mount_chat_page
from minivllm.entrypoints.openai.cli_args import (
    api_key_from,
    engine_args_from,
    load_chat_template,
    validate_parsed_serve_args,
)
from minivllm.entrypoints.openai.errors import (
    BadRequestError,
    NotFoundError,
    OpenAIServingError,
    error_body,
)
from minivllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ClassificationRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingChatRequest,
    EmbeddingCompletionRequest,
    LoadLoRAAdapterRequest,
    RerankRequest,
    ScoreRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    UnloadLoRAAdapterRequest,
)
from minivllm.entrypoints.openai.serving_chat import OpenAIServingChat
from minivllm.entrypoints.openai.serving_classification import OpenAIServingClassification
from minivllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from minivllm.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from minivllm.entrypoints.openai.serving_engine import ServedModels, ServerLifecycle
from minivllm.entrypoints.openai.serving_score import OpenAIServingScores
from minivllm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from minivllm.entrypoints.profiling import add_profile_routes
from minivllm.logger import configure_logging
from minivllm.lora.request import LoRARequest
from minivllm.metrics.loggers import LoggingStatLogger, PrometheusStatLogger, StatLoggerManager

logger = logging.getLogger(__name__)

# How long /metrics and the log line wait for the engine core's statistics.
STATS_TIMEOUT_S = 5.0
# Status for a request whose client went away (nginx's "client closed request"); nobody
# reads it.
CLIENT_CLOSED_REQUEST = 499

router = APIRouter()


# ---------------------------------------------------------------------------- routes


def _state(raw_request: Request):
    return raw_request.app.state


@router.get("/health")
@router.get("/ping")
@router.post("/ping")
async def health(raw_request: Request) -> Response:
    try:
        await _state(raw_request).engine.check_health()
    except Exception as exc:
        body = error_body(HTTPStatus.SERVICE_UNAVAILABLE, f"The engine is dead: {exc}")
        return JSONResponse(body, status_code=HTTPStatus.SERVICE_UNAVAILABLE)
    return Response(status_code=HTTPStatus.OK)


@router.get("/version")
async def version() -> JSONResponse:
    return JSONResponse({"version": minivllm.__version__})


@router.get("/metrics")
async def metrics(raw_request: Request) -> Response:
    state = _state(raw_request)
    await refresh_scheduler_stats(state)
    return Response(
        state.stat_loggers.prometheus.render(), media_type=prometheus_client.CONTENT_TYPE_LATEST
    )


@router.get("/v1/models")
async def show_available_models(raw_request: Request) -> JSONResponse:
    return JSONResponse(_state(raw_request).models.list().model_dump())


def _runtime_lora(raw_request: Request) -> ServedModels:
    """The served models, where adapters may be loaded now (vLLM's switch and flag)."""
    if not envs.MINIVLLM_ALLOW_RUNTIME_LORA_UPDATING:
        raise NotFoundError("Not Found")  # the routes are off, as vLLM leaves them out
    state = _state(raw_request)
    if state.engine.vllm_config.lora_config is None:
        raise BadRequestError("LoRA is not enabled: start the server with --enable-lora.")
    return state.models


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: LoadLoRAAdapterRequest, raw_request: Request) -> Response:
    models = _runtime_lora(raw_request)
    await models.load_lora_adapter(_state(raw_request).engine, request.lora_name, request.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: UnloadLoRAAdapterRequest, raw_request: Request) -> Response:
    _runtime_lora(raw_request).unload_lora_adapter(request.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' removed successfully.")


@router.get("/v1/models/{model_id:path}")
async def show_model(model_id: str, raw_request: Request) -> JSONResponse:
    """The openai client's models.retrieve: the model's card, or a 404."""
    for card in _state(raw_request).models.list().data:
        if card.id == model_id:
            return JSONResponse(card.model_dump())
    raise NotFoundError(f"The model `{model_id}` does not exist.", param="model")


@router.post("/tokenize")
async def tokenize(body: dict, raw_request: Request) -> JSONResponse:
    # Chat messages or a prompt: chosen by the body's keys, for errors that make sense.
    kind = TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest
    request = kind.model_validate(body)
    response = await _state(raw_request).serving_tokenization.tokenize(request)
    return JSONResponse(response.model_dump())


@router.post("/detokenize")
async def detokenize(request: DetokenizeRequest, raw_request: Request) -> JSONResponse:
    response = await _state(raw_request).serving_tokenization.detokenize(request)
    return JSONResponse(response.model_dump())


def _handler(raw_request: Request, name: str, api: str):
    """The state's handler for an API, or vLLM's 400 when the model's runner lacks it (a
    pooling model generates nothing; a generative one gives no embeddings)."""
    handler = getattr(_state(raw_request), name)
    if handler is None:
        raise BadRequestError(f"The model does not support {api} API")
    return handler


@router.post("/v1/completions")
async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
    handler = _handler(raw_request, "serving_completion", "Completions")
    return await run_unless_disconnected(
        raw_request, handler.create_completion(request, raw_request)
    )


@router.post("/v1/chat/completions")
async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
    handler = _handler(raw_request, "serving_chat", "Chat Completions")
    return await run_unless_disconnected(
        raw_request, handler.create_chat_completion(request, raw_request)
    )


@router.post("/v1/embeddings")
async def create_embedding(body: dict, raw_request: Request) -> Response:
    handler = _handler(raw_request, "serving_embedding", "Embeddings")
    # Chat messages or an input: chosen by the body's keys, for errors that make sense.
    kind = EmbeddingChatRequest if "messages" in body else EmbeddingCompletionRequest
    request = kind.model_validate(body)
    return await run_unless_disconnected(
        raw_request, handler.create_embedding(request, raw_request)
    )


@router.post("/score")
@router.post("/v1/score")
async def create_score(request: ScoreRequest, raw_request: Request) -> Response:
    handler = _handler(raw_request, "serving_scores", "Score")
    return await run_unless_disconnected(raw_request, handler.create_score(request, raw_request))


@router.post("/classify")
async def create_classify(request: ClassificationRequest, raw_request: Request) -> Response:
    handler = _handler(raw_request, "serving_classification", "Classification")
    return await run_unless_disconnected(raw_request, handler.create_classify(request, raw_request))


@router.post("/rerank")
@router.post("/v1/rerank")
@router.post("/v2/rerank")
async def do_rerank(request: RerankRequest, raw_request: Request) -> Response:
    handler = _handler(raw_request, "serving_scores", "Rerank")
    return await run_unless_disconnected(raw_request, handler.do_rerank(request, raw_request))


async def _wait_for_disconnect(raw_request: Request) -> None:
    while True:
        message = await raw_request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_unless_disconnected(raw_request: Request, handler) -> Response:
    """Run a handler; cancel it (which aborts its engine requests) if the client leaves.

    A streaming handler returns at once; its response then watches the connection itself.
    """
    task = asyncio.ensure_future(handler)
    watcher = asyncio.ensure_future(_wait_for_disconnect(raw_request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
    if task.cancelled():
        logger.info("The client disconnected; its request was aborted.")
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return task.result()


# ---------------------------------------------------------------------------- errors


def _json_error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


_UNION_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _location(error: dict) -> list[str]:
    """An error's place in the body, without pydantic's tags for the branches of a union."""
    return [
        str(part)
        for part in error.get("loc", ())
        if part != "body"
        and not (isinstance(part, str) and ("[" in part or "(" in part or part in _UNION_TAGS))
    ]


def describe_validation_errors(errors: list[dict]) -> tuple[str, str | None]:
    """One readable message for pydantic's errors, and the parameter they concern."""
    if not errors:
        return "Invalid request.", None
    # A check of ours (a ValueError in a validator) says more than the type errors of the
    # union branches that did not match.
    errors = [e for e in errors if e.get("type") == "value_error"] or errors
    first = errors[0]
    loc = _location(first)
    param = loc[0] if loc else None
    kind = first.get("type", "")
    if kind == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return f"The request body is not valid JSON: {detail}".strip(), None
    if kind in ("model_attributes_type", "dict_type", "model_type") and not loc:
        return (
            "The request body must be a JSON object, sent with Content-Type: application/json.",
            None,
        )
    if kind == "extra_forbidden":
        return f"Unsupported parameter: '{'.'.join(loc)}'.", param
    if kind == "missing" and not loc:
        return (
            "The request body is empty: send a JSON object, with Content-Type: application/json.",
            None,
        )
    if kind == "missing":
        return f"Missing required parameter: '{'.'.join(loc)}'.", param
    messages = []
    for error in errors[:3]:
        text = str(error.get("msg", ""))
        if error.get("type") == "value_error":
            messages.append(text.removeprefix("Value error, "))
        else:
            where = ".".join(_location(error))
            messages.append(f"{where}: {text}" if where else text)
    return "; ".join(dict.fromkeys(messages)), param


def add_exception_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIServingError)
    async def _serving_error(_, exc: OpenAIServingError):
        return _json_error(exc.status, exc.message, exc.param)

    @app.exception_handler(RequestValidationError)
    @app.exception_handler(pydantic.ValidationError)
    async def _validation_error(_, exc: RequestValidationError | pydantic.ValidationError):
        message, param = describe_validation_errors(list(exc.errors()))
        return _json_error(HTTPStatus.BAD_REQUEST, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_, exc: StarletteHTTPException):
        return _json_error(exc.status_code, str(exc.detail))

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_, exc: EngineDeadError):
        return _json_error(HTTPStatus.SERVICE_UNAVAILABLE, f"The engine is dead: {exc}")

    @app.exception_handler(Exception)
    async def _internal_error(_, exc: Exception):
        logger.exception("Unhandled error in a request", exc_info=exc)
        return _json_error(
            HTTPStatus.INTERNAL_SERVER_ERROR, f"Internal server error: {type(exc).__name__}"
        )


# ---------------------------------------------------------------------------- middleware


class APIKeyMiddleware:
    """Requires `Authorization: Bearer <key>` on /v1 routes, as vLLM does; CORS preflight
    (OPTIONS) and the operational routes (/health, /metrics, ...) stay open."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] == "OPTIONS"
            or not scope["path"].startswith("/v1")
        ):
            await self.app(scope, receive, send)
            return
        given = Headers(scope=scope).get("authorization", "").encode()
        if secrets.compare_digest(given, self.expected):
            await self.app(scope, receive, send)
            return
        response = _json_error(HTTPStatus.UNAUTHORIZED, "Invalid or missing API key.")
        await response(scope, receive, send)


class BodySizeLimitMiddleware:
    """Answers 413 to a request body over `max_bytes`, before reading it whole: at once when
    Content-Length says so, else as soon as the chunks read so far exceed it (a chunked
    body is buffered up to the limit, then handed to the app)."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> JSONResponse:
        return _json_error(
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
            f"The request body is larger than the server's limit of {self.max_bytes} bytes "
            "(--max-request-body-size).",
        )

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length")
        if length is not None:
            if not length.isdigit() or int(length) > self.max_bytes:
                await self._too_large()(scope, receive, send)
                return
            await self.app(scope, receive, send)  # the HTTP server stops at Content-Length
            return
        if scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        # No Content-Length (chunked): read up to the limit, then replay to the app.
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await self._too_large()(scope, receive, send)
                return
            if not message.get("more_body", False):
                break

        async def replay():
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)


# ---------------------------------------------------------------------------- statistics


class SchedulerStatsPoller:
    """Asks the engine core for its scheduler statistics, one question at a time.

    The core answers between two steps. A question that takes longer than the caller
    waits is left running, never cancelled, and the caller gets the statistics of the
    latest step meanwhile.
    """

    def __init__(self, engine) -> None:
        self.engine = engine
        self._pending: asyncio.Future | None = None

    async def poll(self, timeout: float):
        if self.engine.errored:
            return None
        if self._pending is None or self._pending.done():
            self._pending = asyncio.ensure_future(self.engine.get_stats())
        pending = self._pending
        done, _ = await asyncio.wait({pending}, timeout=timeout)
        if done and not pending.cancelled() and pending.exception() is None:
            return pending.result()
        return getattr(self.engine, "last_stats", None)


async def refresh_scheduler_stats(state) -> None:
    """Record the engine core's scheduler statistics as they are now."""
    stats = await state.stats_poller.poll(STATS_TIMEOUT_S)
    if stats is not None:
        state.stat_loggers.record(scheduler_stats=stats)


async def _log_stats_forever(state, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        try:
            await refresh_scheduler_stats(state)
            state.stat_loggers.log()
        except Exception:
            logger.exception("Could not log the engine's statistics")


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI):
    state = app.state
    task = None
    if state.stat_loggers.logging_logger is not None and state.log_stats_interval > 0:
        task = asyncio.create_task(_log_stats_forever(state, state.log_stats_interval))
    try:
        yield
    finally:
        if task is not None:
            task.cancel()


# ---------------------------------------------------------------------------- the app


def build_app(args: argparse.Namespace) -> FastAPI:
    """The routes, the error handlers and the middleware; init_app_state adds the engine."""
    app = FastAPI(title="minivllm", version=minivllm.__version__, lifespan=_lifespan)
    app.include_router(router)
    add_profile_routes(app)
    if not getattr(args, "disable_chat_page", False):
        mount_chat_page(app)
    add_exception_handlers(app)
    api_key = api_key_from(args)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    if args.max_request_body_size:
        app.add_middleware(BodySizeLimitMiddleware, max_bytes=args.max_request_body_size)
    # Added last, so it is the outermost: 401s and errors carry the CORS headers too.
    app.add_middleware(
        CORSMiddleware,
        allow_origins=args.allowed_origins,
        allow_credentials=args.allow_credentials,
        allow_methods=args.allowed_methods,
        allow_headers=args.allowed_headers,
    )
    return app


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
    prometheus = PrometheusStatLogger(
        names[0],
        model_config.max_model_len,
        cache_info={
            "block_size": str(cache_config.block_size),
            "enable_prefix_caching": str(cache_config.enable_prefix_caching),
            "num_gpu_blocks": str(getattr(engine.engine_core, "num_blocks", None)),
        },
        max_loras=lora_config.max_loras
        if (lora_config := engine.vllm_config.lora_config)
        else None,
    )
    logging_logger = (
        None if args.disable_log_stats else LoggingStatLogger(device=engine.vllm_config.device)
    )
    state.engine = engine
    state.models = models
    state.stat_loggers = StatLoggerManager(prometheus, logging_logger)
    state.stats_poller = SchedulerStatsPoller(engine)
    state.log_stats_interval = args.log_stats_interval
    state.lifecycle = ServerLifecycle()
    common = dict(
        engine=engine,
        tokenizer=tokenizer,
        models=models,
        stat_loggers=state.stat_loggers,
        scheduling_policy=engine.vllm_config.scheduler_config.policy,
        vocab_size=model_config.vocab_size,
        max_logprobs=args.max_logprobs,
        chat_template=load_chat_template(args.chat_template),
        max_n=args.max_n,
        lifecycle=state.lifecycle,
        default_sampling_params=model_config.get_diff_sampling_param(),
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


# ---------------------------------------------------------------------------- running


def setup_logging() -> None:
    """vLLM's log format for minivllm's loggers, unless the application set its own: the
    server prints its start-up lines even where MINIVLLM_CONFIGURE_LOGGING=0."""
    configure_logging(envs.MINIVLLM_LOGGING_LEVEL)


def _bind(host: str, port: int) -> socket.socket:
    """Take the port before loading the model, so that a busy port fails at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


class GracefulServer(uvicorn.Server):
    """uvicorn's server, with vLLM-like graceful shutdown on SIGINT and SIGTERM.

    The first signal stops accepting connections (uvicorn) and refuses new requests with a
    503; the requests in flight get `shutdown_timeout` seconds to finish, then are ended
    with an error (a stream gets an error event and [DONE]), so every client sees its
    response end and uvicorn never has to cancel a task (no traceback). A second SIGINT
    quits at once. The signal is not raised again afterwards: the exit is a clean one.
    """

    def __init__(self, config: uvicorn.Config, state, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.state = state
        self.shutdown_timeout = shutdown_timeout
        self.loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets=sockets)

    def handle_exit(self, sig, frame) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
            return
        if self.should_exit:
            return
        self.should_exit = True
        logger.info("Shutting down (%s): no new requests; %.1f s for those in flight.",
                    signal.Signals(sig).name, self.shutdown_timeout)  # fmt: skip
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._start_draining)

    def _start_draining(self) -> None:
        lifecycle = self.state.lifecycle
        lifecycle.draining = True

        def cancel_in_flight() -> None:
            if lifecycle.active:
                logger.info("Ending %d request(s) still in flight.", len(lifecycle.active))
            asyncio.ensure_future(lifecycle.cancel_all(self.state.engine))

        self.loop.call_later(self.shutdown_timeout, cancel_in_flight)


async def serve(args: argparse.Namespace, engine, sock: socket.socket) -> None:
    app = build_app(args)
    await init_app_state(engine, app.state, args)
    config = uvicorn.Config(
        app,
        log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        timeout_keep_alive=5,
        # uvicorn cancels what is left after this; the requests end before, at the timeout.
        timeout_graceful_shutdown=args.shutdown_timeout + 1,
    )
    server = GracefulServer(config, app.state, args.shutdown_timeout)
    host, port = sock.getsockname()[:2]
    logger.info("minivllm %s serving %s on http://%s:%d", minivllm.__version__,
                app.state.models.base_name, host, port)  # fmt: skip
    await server.serve(sockets=[sock])


def run_server(args: argparse.Namespace, engine_core: AsyncMPClient | None = None) -> None:
    """`minivllm serve`: load the engine, then serve until SIGINT or SIGTERM. engine_core:
    the core's process, started for these arguments already (``start_engine_core``)."""
    from minivllm.engine.async_llm import AsyncLLM

    try:
        setup_logging()
        engine_args = engine_args_from(args)
        load_chat_template(args.chat_template)  # a bad value fails before the model loads
        validate_parsed_serve_args(args)
        sock = _bind(args.host, args.port)
    except BaseException:
        if engine_core is not None:
            engine_core.shutdown()
        raise
    try:
        engine = AsyncLLM.from_engine_args(engine_args, engine_core)
        try:
            asyncio.run(serve(args, engine, sock))
        finally:
            engine.shutdown()
    finally:
        sock.close()


def exit_server_process() -> None:
    """End the process after run_server returned: flush, then skip the interpreter's teardown.

    Everything is stopped and freed by then (engine core, sockets); the teardown of torch and
    the tokenizers only costs time (seconds on a loaded machine), and the server must exit
    within its shutdown timeout plus 2 s.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv: list[str] | None = None) -> None:
    """`python -m minivllm.entrypoints.openai.api_server`: vLLM's module entry point, with the
    flags of `minivllm serve`."""
    from minivllm.entrypoints.openai.cli_args import make_arg_parser
    from minivllm.utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(
        prog="python -m minivllm.entrypoints.openai.api_server",
        description="The OpenAI-compatible API server (the same flags as `minivllm serve`).",
    )
    run_server(make_arg_parser(parser).parse_args(argv))
    exit_server_process()


if __name__ == "__main__":
    main()
