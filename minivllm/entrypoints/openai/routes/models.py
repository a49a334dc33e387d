"""A many-model server's model management, under llama.cpp's names: POST /models/load and
POST /models/unload with {"model": NAME} (behind the API key like /v1)."""

from __future__ import annotations

import json

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from minivllm.entrypoints.openai.errors import BadRequestError, NotFoundError
from minivllm.entrypoints.openai.routes.common import app_state

router = APIRouter()


async def _router_and_name(raw_request: Request):
    router = getattr(app_state(raw_request), "model_router", None)
    if router is None:
        raise NotFoundError("Not Found: models are loaded and unloaded by a server started "
                            "with --models-dir or --model NAME=SOURCE.")  # fmt: skip
    try:
        body = json.loads(await raw_request.body() or b"{}")
    except ValueError:
        body = None
    name = body.get("model") if isinstance(body, dict) else None
    if not isinstance(name, str) or not name:
        raise BadRequestError('The body must be {"model": NAME}.', param="model")
    return router, name


@router.post("/models/load")
async def load_model(raw_request: Request) -> JSONResponse:
    """Load a model now (waiting for it); one that is down gets its chances again."""
    router, name = await _router_and_name(raw_request)
    model = await router.load(name)
    return JSONResponse({"success": True, "model": name, "state": model.status_now()})


@router.post("/models/unload")
async def unload_model(raw_request: Request) -> JSONResponse:
    """Unload a model now: its engine core stops, its requests in flight end with an error."""
    router, name = await _router_and_name(raw_request)
    await router.unload(name)
    return JSONResponse({"success": True, "model": name, "state": router.get(name).status_now()})
