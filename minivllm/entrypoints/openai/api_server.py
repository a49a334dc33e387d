"""The OpenAI-compatible server: FastAPI routes over one AsyncLLM, run by uvicorn.

Routes: /v1/completions and /v1/chat/completions (a generative model), /v1/embeddings,
/score and /rerank (a pooling model, --runner pooling: an embedding model or a cross-encoder;
also under /v1, /rerank under /v2), /classify (a sequence classifier), /v1/models[/{id}],
/tokenize, /detokenize, /health, /ping, /version, /metrics, the chat page at / (unless
--disable-chat-page), /tokenizer_info with --enable-tokenizer-info-endpoint, and
/start_profile, /stop_profile while a profiler folder is set.
This module is the app and its life: build_app puts together the routes (routes/, one module
per API family), the error handlers (errors.py) and the middleware (middleware.py);
app_state.py adds the engine and the handlers; GracefulServer runs it with uvicorn. On SIGINT
or SIGTERM the server stops accepting, gives the requests in flight --shutdown-timeout
seconds, then ends them with an error (streams: an error event, then [DONE]) and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import signal
import socket
import sys
import threading

import uvicorn
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

import minivllm
from minivllm import envs
from minivllm.engine.core_client import AsyncMPClient
from minivllm.entrypoints.openai.app_state import init_app_state
from minivllm.entrypoints.openai.chat_page import mount_chat_page
from minivllm.entrypoints.openai.cli_args import (
    api_key_from,
    engine_args_from,
    load_chat_template,
    validate_parsed_serve_args,
)
from minivllm.entrypoints.openai.connection_guard import guarded_h11_protocol, raise_fd_limit
from minivllm.entrypoints.openai.errors import add_exception_handlers
from minivllm.entrypoints.openai.middleware import (
    APIKeyMiddleware,
    BodySizeLimitMiddleware,
    HostCheckMiddleware,
    RequestIdHeaderMiddleware,
    allowed_hosts_for,
)
from minivllm.entrypoints.openai.model_router_args import is_many_models
from minivllm.entrypoints.openai.model_router_middleware import ModelRouterMiddleware
from minivllm.entrypoints.openai.routes import ROUTERS
from minivllm.entrypoints.openai.routes.tokenization import tokenizer_info_router
from minivllm.entrypoints.openai.server_stats import log_stats_forever
from minivllm.entrypoints.profiling import add_profile_routes
from minivllm.logger import configure_logging

logger = logging.getLogger(__name__)


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI):
    state = app.state
    task = None
    if state.stat_loggers.logging_logger is not None and state.log_stats_interval > 0:
        task = asyncio.create_task(log_stats_forever(state, state.log_stats_interval))
    try:
        yield
    finally:
        if task is not None:
            task.cancel()


def build_app(args: argparse.Namespace) -> FastAPI:
    """The routes, the error handlers and the middleware; init_app_state adds the engine."""
    docs = {} if not getattr(args, "disable_fastapi_docs", False) else {
        "docs_url": None, "redoc_url": None, "openapi_url": None}  # fmt: skip
    app = FastAPI(title="minivllm", version=minivllm.__version__, lifespan=_lifespan, **docs)
    for router in ROUTERS:
        app.include_router(router)
    if getattr(args, "enable_tokenizer_info_endpoint", False):
        app.include_router(tokenizer_info_router)
    add_profile_routes(app)
    if not getattr(args, "disable_chat_page", False):
        mount_chat_page(app)
    add_exception_handlers(app)
    if is_many_models(args):  # added first, so innermost: after the key and the body limit
        app.add_middleware(ModelRouterMiddleware)
    api_key = api_key_from(args)
    if api_key:
        app.add_middleware(
            APIKeyMiddleware,
            api_key=api_key,
            all_routes=getattr(args, "api_key_all_routes", False),
        )
    if args.max_request_body_size:
        app.add_middleware(BodySizeLimitMiddleware, max_bytes=args.max_request_body_size)
    # CORS only where origins are named: the chat page is same-origin and needs none, and a
    # page on any other site must not drive the server through a visitor's browser.
    if args.allowed_origins:
        # Added after the others, so it wraps them: 401s and errors carry its headers too.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=args.allowed_origins,
            allow_credentials=args.allow_credentials,
            allow_methods=args.allowed_methods,
            allow_headers=args.allowed_headers,
        )
    if getattr(args, "enable_request_id_headers", False):  # on errors and 401s too
        app.add_middleware(RequestIdHeaderMiddleware)
    hosts = allowed_hosts_for(args.host, getattr(args, "allowed_hosts", None))
    if hosts is not None:  # the outermost: a rebound name gets nothing else
        app.add_middleware(HostCheckMiddleware, allowed=hosts)
    return app


def setup_logging() -> None:
    """vLLM's log format for minivllm's loggers, unless the application set its own: the
    server prints its start-up lines even where MINIVLLM_CONFIGURE_LOGGING=0."""
    configure_logging(envs.MINIVLLM_LOGGING_LEVEL)


def bind_socket(host: str, port: int) -> socket.socket:
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
        _exit_if_stuck(self.shutdown_timeout + 1.5)
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


def _exit_if_stuck(after: float) -> None:
    """End the process `after` seconds from now unless it has ended by then: a request that
    holds the event loop (or a thread it waits on) cannot keep the server from exiting on
    SIGTERM. The engine core process ends with its parent."""

    def force_exit() -> None:
        logger.warning("Still running %.1f s after the signal: exiting now.", after)
        logging.shutdown()
        os._exit(1)

    timer = threading.Timer(after, force_exit)
    timer.daemon = True
    timer.start()


async def serve(
    args: argparse.Namespace, engine, sock: socket.socket, init_state=init_app_state
) -> None:
    """init_state(engine, app.state, args) fills the app's state (a many-model server's
    differs)."""
    app = build_app(args)
    await init_state(engine, app.state, args)
    max_connections = raise_fd_limit(getattr(args, "max_connections", 16384))
    config = uvicorn.Config(
        app,
        log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        # The connection cap and the head deadline (connection_guard), over uvicorn's h11.
        http=guarded_h11_protocol(max_connections, getattr(args, "header_timeout", 10.0)),
        timeout_keep_alive=getattr(args, "timeout_keep_alive", 5.0),
        h11_max_incomplete_event_size=getattr(args, "h11_max_incomplete_event_size", None),
        # uvicorn cancels what is left after this; the requests end before, at the timeout.
        timeout_graceful_shutdown=args.shutdown_timeout + 1,
        root_path=getattr(args, "root_path", "") or "",
        ssl_keyfile=getattr(args, "ssl_keyfile", None),
        ssl_certfile=getattr(args, "ssl_certfile", None),
    )
    server = GracefulServer(config, app.state, args.shutdown_timeout)
    # As vLLM's server: the start-up heap (tokenizers, the app, its handlers) becomes
    # permanent, so that the collector's full passes, each a pause of the event loop, no
    # longer walk it (a refused 600 kB logit_bias took 170 ms every other time, 23 after).
    gc.collect()
    gc.freeze()
    host, port = sock.getsockname()[:2]
    scheme = "https" if getattr(args, "ssl_certfile", None) else "http"
    logger.info("minivllm %s serving %s on %s://%s:%d%s", minivllm.__version__,
                app.state.models.base_name, scheme, host, port, config.root_path)  # fmt: skip
    await server.serve(sockets=[sock])


def run_server(args: argparse.Namespace, engine_core: AsyncMPClient | None = None) -> None:
    """`minivllm serve`: load the engine, then serve until SIGINT or SIGTERM. engine_core:
    the core's process, started for these arguments already (``start_engine_core``)."""
    from minivllm.engine.async_llm import AsyncLLM

    if is_many_models(args):
        _run_many_models(args)
        return
    try:
        setup_logging()
        engine_args = engine_args_from(args)
        load_chat_template(args.chat_template)  # a bad value fails before the model loads
        validate_parsed_serve_args(args)
        sock = bind_socket(args.host, args.port)
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


def _run_many_models(args: argparse.Namespace) -> None:
    """`minivllm serve --models-dir DIR` / `--model NAME=SOURCE`: no engine until a request
    names its model (many_models_server.py)."""
    from minivllm.entrypoints.openai.many_models_server import run_many_models_server

    setup_logging()
    load_chat_template(args.chat_template)
    validate_parsed_serve_args(args)
    sock = bind_socket(args.host, args.port)
    try:
        run_many_models_server(args, sock)
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
