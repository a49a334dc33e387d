"""The simple demo server of vLLM's `vllm.entrypoints.api_server`: one prompt in, text out.

`POST /generate` takes `{"prompt": str, "stream": bool, <SamplingParams fields>}` and
answers `{"text": [prompt + completion, ...]}` (one entry per sample). With `stream` true,
each engine step's outputs so far are sent as such an object, the objects separated by NUL
bytes, as vLLM's server sends them. A client that disconnects aborts its request.
`GET /health` answers 200 while the engine runs. For the OpenAI API, use
`minivllm.entrypoints.openai.api_server` (or `minivllm serve`).

    python -m minivllm.entrypoints.api_server --model DIR_OR_GGUF --port 8000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import uuid
from collections.abc import AsyncGenerator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from minivllm.engine.arg_utils import AsyncEngineArgs
from minivllm.entrypoints.openai.api_server import bind_socket, setup_logging
from minivllm.entrypoints.openai.cli_args import add_engine_args
from minivllm.entrypoints.openai.errors import ErrorResponse
from minivllm.entrypoints.openai.routes.common import run_unless_disconnected
from minivllm.entrypoints.profiling import add_profile_routes
from minivllm.sampling_params import SamplingParams
from minivllm.slo_params import SLO_FIELDS, slo_params_from_fields
from minivllm.utils import FlexibleArgumentParser

logger = logging.getLogger(__name__)

# slo_params comes from the SLO fields (is_latency_sensitive, slo, slo_ttft) as elsewhere.
_SAMPLING_FIELDS = frozenset(SamplingParams.__struct_fields__) - {"slo_params"}


def _error(status: int, message: str) -> JSONResponse:
    return ErrorResponse({"error": message}, status_code=status)


def sampling_params_from(body: dict) -> SamplingParams:
    """The request's SamplingParams fields; fields that are not one are ignored with a warning,
    as the OpenAI server does. Raises ValueError or TypeError on a bad value."""
    slo = slo_params_from_fields(*(body.pop(name, None) for name in SLO_FIELDS))
    unknown = sorted(k for k in body if k not in _SAMPLING_FIELDS)
    if unknown:
        logger.warning(
            "The following fields were present in the request but ignored: %s",
            ", ".join(unknown),
        )
    fields = {k: v for k, v in body.items() if k in _SAMPLING_FIELDS}
    return SamplingParams(**fields, slo_params=slo)


def build_app(engine) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> Response:
        await engine.check_health()
        return Response(status_code=200)

    @app.post("/generate")
    async def generate(raw_request: Request) -> Response:
        try:
            body = await raw_request.json()
        except ValueError as exc:
            return _error(400, f"The request body is not valid JSON: {exc}")
        if not isinstance(body, dict) or not isinstance(body.get("prompt"), str):
            return _error(400, 'The body must be a JSON object with a string "prompt".')
        prompt = body.pop("prompt")
        stream = bool(body.pop("stream", False))
        try:
            params = sampling_params_from(body)
        except (ValueError, TypeError) as exc:
            return _error(400, str(exc))
        request_id = uuid.uuid4().hex
        try:
            results = engine.generate(prompt, params, request_id)
            first = await anext(results)  # invalid prompts fail here, before any byte is sent
        except ValueError as exc:
            return _error(400, str(exc))

        def texts(output) -> list[str]:
            return [prompt + completion.text for completion in output.outputs]

        if stream:

            async def chunks() -> AsyncGenerator[bytes, None]:
                # Closing this generator (the client went away) closes `results`, which
                # aborts the request in the engine.
                output = first
                try:
                    while True:
                        yield (json.dumps({"text": texts(output)}) + "\0").encode()
                        if output.finished:
                            return
                        output = await anext(results)
                finally:
                    await results.aclose()

            return StreamingResponse(chunks(), media_type="application/octet-stream")

        async def collect() -> Response:
            final = first
            try:
                while not final.finished:
                    final = await anext(results)
            finally:
                await results.aclose()
            return JSONResponse({"text": texts(final)})

        return await run_unless_disconnected(raw_request, collect())

    app.state.engine = engine
    add_profile_routes(app)
    return app


def make_arg_parser() -> argparse.ArgumentParser:
    parser = FlexibleArgumentParser(
        prog="python -m minivllm.entrypoints.api_server",
        description="The simple demo server (POST /generate); the engine flags of "
        "`minivllm serve`.",
    )
    parser.add_argument("--host", default="0.0.0.0", help="Address to listen on.")
    parser.add_argument("--port", type=int, default=8000, help="Port to listen on.")
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="Log level of uvicorn (the HTTP server).",
    )
    add_engine_args(parser)
    return parser


async def serve(app: FastAPI, sock, log_level: str) -> None:
    config = uvicorn.Config(app, log_level=log_level, timeout_keep_alive=5)
    await uvicorn.Server(config).serve(sockets=[sock])


def main(argv: list[str] | None = None) -> None:
    from dataclasses import fields

    from minivllm.engine.async_llm import AsyncLLM

    args = make_arg_parser().parse_args(argv)
    setup_logging()
    names = {f.name for f in fields(AsyncEngineArgs)}
    engine_args = AsyncEngineArgs(**{k: v for k, v in vars(args).items() if k in names})
    sock = bind_socket(args.host, args.port)
    try:
        engine = AsyncLLM.from_engine_args(engine_args)
        try:
            host, port = sock.getsockname()[:2]
            logger.info("minivllm demo server on http://%s:%d (POST /generate)", host, port)
            asyncio.run(serve(build_app(engine), sock, args.log_level))
        finally:
            engine.shutdown()
    finally:
        sock.close()


if __name__ == "__main__":
    main()
