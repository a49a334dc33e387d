"""The middleware of a many-model server: each POST request's body names its model
(`model`), which the router loads if need be; the routes then find that model's state
(routes/common.app_state) as if the server served it alone. Ollama's per-request
`keep_alive` is honoured here. The router's refusals are answered in the request's API
family's error shape, with Retry-After on a 503 to retry."""

from __future__ import annotations

import json
import re
from http import HTTPStatus

from fastapi.responses import JSONResponse

from minivllm.entrypoints.openai.errors import (
    BadRequestError,
    ErrorResponse,
    OpenAIServingError,
    error_body,
)
from minivllm.entrypoints.openai.routes.common import MODEL_STATE_KEY

# POST routes that name no model of the catalog (or name it to manage it, not to use it).
_NO_MODEL_PATHS = frozenset(
    {
        "/models/load",
        "/models/unload",
        "/ping",
        "/start_profile",
        "/stop_profile",
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
    }
)
# GET routes about one model, named in the query (?model=NAME), which the router loads.
_QUERY_MODEL_PATHS = frozenset({"/tokenizer_info"})
# POST routes that describe a model: a loaded one answers itself, one not loaded is answered
# from its config without starting its engine core.
_DESCRIBE_PATHS = frozenset({"/api/show"})
# Ollama's durations: "5m", "1h30m", "300ms", "10s"; a bare number is seconds.
_DURATION = re.compile(r"(-?[0-9.]+)(ms|s|m|h)")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_keep_alive(value) -> float | None:
    """Ollama's keep_alive in seconds (inf: forever, for a negative one); None where absent
    or unreadable (the server's --keep-alive applies)."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            parts = _DURATION.findall(text)
            if not parts or "".join(n + u for n, u in parts) != text:
                return None
            seconds = sum(float(n) * _UNIT_S[u] for n, u in parts)
    else:
        return None
    return float("inf") if seconds < 0 else seconds


def error_response(path: str, exc: OpenAIServingError) -> JSONResponse:
    """The router's error as the API at ``path`` writes errors."""
    status = int(exc.status)
    if path.startswith("/api/"):
        body = {"error": exc.message}
    elif path.startswith("/v1/messages"):
        from minivllm.entrypoints.anthropic.protocol import error_body as anthropic_error_body

        body = anthropic_error_body(status, exc.message)
    else:
        body = error_body(status, exc.message, exc.param)
    headers = {}
    retry_after = getattr(exc, "retry_after", None)
    if retry_after is not None and status == HTTPStatus.SERVICE_UNAVAILABLE:
        headers["Retry-After"] = str(retry_after)
    return ErrorResponse(body, status_code=status, headers=headers)


class ModelRouterMiddleware:
    """Reads a POST request's body for its `model`, holds that model (loaded) while the
    request runs, and hands the request its state."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] in _QUERY_MODEL_PATHS:
            router = scope["app"].state.model_router
            if getattr(router.args, "enable_tokenizer_info_endpoint", False):
                await self._for_query_model(scope, receive, send)
                return
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] in _NO_MODEL_PATHS:
            await self.app(scope, receive, send)
            return
        router = scope["app"].state.model_router
        messages = []  # read whole (the body limit's middleware bounds it), then replayed
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request" or not message.get("more_body", False):
                break
        body = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.request")

        async def replay():
            return messages.pop(0) if messages else await receive()

        try:
            fields = json.loads(body) if body else {}
        except ValueError:
            fields = None  # not JSON: the route says so
        if not isinstance(fields, dict):
            await self.app(scope, replay, send)
            return
        name = fields.get("model")
        if (name is None or name == "") and len(router.models) == 1:
            name = next(iter(router.models))
        path = scope["path"]
        if path in _DESCRIBE_PATHS and not _is_loaded(router, name):
            await self.app(scope, replay, send)  # answered from its config (router.describe)
            return
        try:
            if not isinstance(name, str) or not name:
                raise _model_required(router)
            keep_alive = (
                parse_keep_alive(fields.get("keep_alive")) if path.startswith("/api/") else None
            )
            model = await router.acquire(name, keep_alive)
        except OpenAIServingError as exc:
            await error_response(path, exc)(scope, replay, send)
            return
        scope[MODEL_STATE_KEY] = model.state
        try:
            await self.app(scope, replay, send)
        finally:
            router.release(model)

    async def _for_query_model(self, scope, receive, send) -> None:
        """A GET naming its model in the query (?model=NAME, vLLM-style), or the only one."""
        from urllib.parse import parse_qs

        router = scope["app"].state.model_router
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        name = (query.get("model") or [None])[0]
        if not name and len(router.models) == 1:
            name = next(iter(router.models))
        try:
            if not name:
                raise _model_required(router)
            model = await router.acquire(name)
        except OpenAIServingError as exc:
            await error_response(scope["path"], exc)(scope, receive, send)
            return
        scope[MODEL_STATE_KEY] = model.state
        try:
            await self.app(scope, receive, send)
        finally:
            router.release(model)


def _is_loaded(router, name) -> bool:
    model = router.models.get(name) if isinstance(name, str) else None
    return model is not None and model.state is not None and not model.is_dead()


def _model_required(router) -> OpenAIServingError:
    return BadRequestError(
        f"`model` is required: one of {', '.join(router.models)}.", param="model"
    )
