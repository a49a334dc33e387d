"""Operational routes: /health and /ping, /version, /metrics (Prometheus), and the served
models (/v1/models, /v1/models/{id}; on a many-model server each with its `state`)."""

from __future__ import annotations

from http import HTTPStatus

import prometheus_client
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

import minivllm
from minivllm.entrypoints.openai.errors import NotFoundError, error_body
from minivllm.entrypoints.openai.routes.common import app_state
from minivllm.entrypoints.openai.server_stats import refresh_scheduler_stats

router = APIRouter()


@router.get("/health")
@router.get("/ping")
@router.post("/ping")
async def health(raw_request: Request) -> Response:
    state = app_state(raw_request)
    if getattr(state, "model_router", None) is not None:  # many models: 200 with each's state
        from minivllm.entrypoints.openai.many_models_server import health as models_health

        return JSONResponse(models_health(state.model_router))
    try:
        engine = state.engine  # (an app without one is an engine that is not there)
        await engine.check_health()
    except Exception as exc:
        body = error_body(HTTPStatus.SERVICE_UNAVAILABLE, f"The engine is dead: {exc}")
        return JSONResponse(body, status_code=HTTPStatus.SERVICE_UNAVAILABLE)
    dead = getattr(engine, "dead_engines", list)()
    if dead:  # data parallelism: some engine cores died, the others serve
        engines = engine.vllm_config.parallel_config.data_parallel_size
        body = {"status": "degraded", "engines": engines, "dead_engines": dead}
        return JSONResponse(body, status_code=HTTPStatus.OK)
    return Response(status_code=HTTPStatus.OK)


@router.get("/version")
async def version() -> JSONResponse:
    return JSONResponse({"version": minivllm.__version__})


@router.get("/metrics")
async def metrics(raw_request: Request) -> Response:
    state = app_state(raw_request)
    await refresh_scheduler_stats(state)
    return Response(
        state.stat_loggers.prometheus.render(), media_type=prometheus_client.CONTENT_TYPE_LATEST
    )


@router.get("/v1/models")
async def show_available_models(raw_request: Request) -> JSONResponse:
    return JSONResponse(app_state(raw_request).models.list().model_dump())


@router.get("/v1/models/{model_id:path}")
async def show_model(model_id: str, raw_request: Request) -> JSONResponse:
    """The openai client's models.retrieve: the model's card, or a 404."""
    for card in app_state(raw_request).models.list().data:
        if card.id == model_id:
            return JSONResponse(card.model_dump())
    raise NotFoundError(f"The model `{model_id}` does not exist.", param="model")
