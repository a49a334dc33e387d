"""OpenAI's generative APIs: /v1/completions and /v1/chat/completions."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from minivllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from minivllm.entrypoints.openai.routes.common import handler_for, run_unless_disconnected

router = APIRouter()


@router.post("/v1/completions")
async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
    handler = handler_for(raw_request, "serving_completion", "Completions")
    return await run_unless_disconnected(
        raw_request, handler.create_completion(request, raw_request)
    )


@router.post("/v1/chat/completions")
async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
    handler = handler_for(raw_request, "serving_chat", "Chat Completions")
    return await run_unless_disconnected(
        raw_request, handler.create_chat_completion(request, raw_request)
    )
