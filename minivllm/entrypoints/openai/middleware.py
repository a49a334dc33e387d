"""Middleware: the API key and the request body size limit, each an ASGI wrapper."""

from __future__ import annotations

import secrets
from http import HTTPStatus

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers

from minivllm.entrypoints.openai.errors import json_error


class APIKeyMiddleware:
    """Requires `Authorization: Bearer <key>` (or Anthropic's `x-api-key: <key>`) on /v1
    routes, as vLLM does; CORS preflight (OPTIONS) and the operational routes (/health,
    /metrics, ...) stay open."""

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
        headers = Headers(scope=scope)
        given = headers.get("authorization", "").encode()
        if "x-api-key" in headers:  # Anthropic's clients send the key this way
            given = f"Bearer {headers['x-api-key']}".encode()
        if secrets.compare_digest(given, self.expected):
            await self.app(scope, receive, send)
            return
        response = json_error(HTTPStatus.UNAUTHORIZED, "Invalid or missing API key.")
        await response(scope, receive, send)


class BodySizeLimitMiddleware:
    """Answers 413 to a request body over `max_bytes`, before reading it whole: at once when
    Content-Length says so, else as soon as the chunks read so far exceed it (a chunked
    body is buffered up to the limit, then handed to the app)."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> JSONResponse:
        return json_error(
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
