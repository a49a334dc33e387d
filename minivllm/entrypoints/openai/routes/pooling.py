"""A pooling model's APIs: /v1/embeddings, /score, /rerank (also under /v1, and /v2/rerank)
and /classify."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from minivllm.entrypoints.openai.protocol import (
    ClassificationRequest,
    EmbeddingChatRequest,
    EmbeddingCompletionRequest,
    RerankRequest,
    ScoreRequest,
)
from minivllm.entrypoints.openai.routes.common import handler_for, run_unless_disconnected

router = APIRouter()


@router.post("/v1/embeddings")
async def create_embedding(body: dict, raw_request: Request) -> Response:
    handler = handler_for(raw_request, "serving_embedding", "Embeddings")
    # Chat messages or an input: chosen by the body's keys, for errors that make sense.
    kind = EmbeddingChatRequest if "messages" in body else EmbeddingCompletionRequest
    request = kind.model_validate(body)
    return await run_unless_disconnected(
        raw_request, handler.create_embedding(request, raw_request)
    )


@router.post("/score")
@router.post("/v1/score")
async def create_score(request: ScoreRequest, raw_request: Request) -> Response:
    handler = handler_for(raw_request, "serving_scores", "Score")
    return await run_unless_disconnected(raw_request, handler.create_score(request, raw_request))


@router.post("/classify")
async def create_classify(request: ClassificationRequest, raw_request: Request) -> Response:
    handler = handler_for(raw_request, "serving_classification", "Classification")
    return await run_unless_disconnected(raw_request, handler.create_classify(request, raw_request))


@router.post("/rerank")
@router.post("/v1/rerank")
@router.post("/v2/rerank")
async def do_rerank(request: RerankRequest, raw_request: Request) -> Response:
    handler = handler_for(raw_request, "serving_scores", "Rerank")
    return await run_unless_disconnected(raw_request, handler.do_rerank(request, raw_request))
