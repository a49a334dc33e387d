"""Middleware, each an ASGI wrapper: the API key, the Host check (against DNS rebinding),
the request body size limit and the X-Request-Id header."""

from __future__ import annotations

import ipaddress
import secrets
from http import HTTPStatus

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers

from minivllm.entrypoints.openai.errors import json_error


class APIKeyMiddleware:
    """Requires `Authorization: Bearer <key>` (the scheme in any case, RFC 7235; or
    Anthropic's `x-api-key: <key>`) on /v1 routes, as vLLM does (and /models/load and
    /models/unload, a many-model server's), or on every route but /health
    with all_routes (--api-key-all-routes); CORS preflight (OPTIONS) stays open: a browser
    sends it without the key."""

    def __init__(self, app, api_key: str, all_routes: bool = False) -> None:
        self.app = app
        self.expected = api_key.encode()
        self.all_routes = all_routes

    def _guards(self, path: str) -> bool:
        if self.all_routes:
            return path != "/health"
        return path.startswith(("/v1", "/models/"))  # /models/load, /models/unload

    async def __call__(self, scope, receive, send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] == "OPTIONS"
            or not self._guards(scope["path"])
        ):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        scheme, _, given = headers.get("authorization", "").partition(" ")
        if "x-api-key" in headers:  # Anthropic's clients send the key this way
            scheme, given = "bearer", headers["x-api-key"]
        if scheme.lower() == "bearer" and secrets.compare_digest(
            given.strip().encode(), self.expected
        ):
            await self.app(scope, receive, send)
            return
        response = json_error(HTTPStatus.UNAUTHORIZED, "Invalid or missing API key.")
        await response(scope, receive, send)


# The names of this machine that a browser on it may use (besides any --allowed-hosts).
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


def allowed_hosts_for(bind_host: str, extra: list[str] | None) -> list[str] | None:
    """The Host header values the server accepts, or None for any. Bound to a loopback
    address, only this machine's own names (and --allowed-hosts): a web page whose name
    resolves to 127.0.0.1 (DNS rebinding) sends its own name, and is refused. Bound to
    another address, any host unless --allowed-hosts names some ("*" in it: any)."""
    extra = list(extra or [])
    if "*" in extra:
        return None
    if is_loopback(bind_host):
        return [*LOOPBACK_HOSTS, *extra]
    return extra or None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The Host header's name, without its port (an IPv6 address keeps no brackets)."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class HostCheckMiddleware:
    """Answers 400 to a request whose Host header is not one of `allowed` (a name, or
    "*.example.com" for its subdomains), before any route runs."""

    def __init__(self, app, allowed: list[str]) -> None:
        self.app = app
        self.names = {h.lower().strip("[]") for h in allowed if not h.startswith("*.")}
        self.suffixes = tuple(h.lower()[1:] for h in allowed if h.startswith("*."))

    def _allows(self, name: str) -> bool:
        return name in self.names or (bool(self.suffixes) and name.endswith(self.suffixes))

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        if self._allows(host_name(Headers(scope=scope).get("host", ""))):
            await self.app(scope, receive, send)
            return
        response = json_error(
            HTTPStatus.BAD_REQUEST,
            "Invalid host header: this server answers only to its own names (start it with "
            "--allowed-hosts to add one).",
        )
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


class RequestIdHeaderMiddleware:
    """--enable-request-id-headers (vLLM's): every response carries an X-Request-Id, the
    request's own header's value or a new id, so that a client can find its request in the
    logs."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = Headers(scope=scope).get("x-request-id") or secrets.token_hex(16)

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k != b"x-request-id"]
                headers.append((b"x-request-id", request_id.encode("latin-1", "replace")))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)
