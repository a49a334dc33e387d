"""vLLM's /tokenize and /detokenize."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from minivllm.entrypoints.openai import protocol
from minivllm.entrypoints.openai.routes.common import app_state

router = APIRouter()


@router.post("/tokenize")
async def tokenize(body: dict, raw_request: Request) -> JSONResponse:
    # Chat messages or a prompt: chosen by the body's keys, for errors that make sense.
    kind = (
        protocol.TokenizeChatRequest if "messages" in body else protocol.TokenizeCompletionRequest
    )
    request = kind.model_validate(body)
    response = await app_state(raw_request).serving_tokenization.tokenize(request)
    return JSONResponse(response.model_dump())


@router.post("/detokenize")
async def detokenize(request: protocol.DetokenizeRequest, raw_request: Request) -> JSONResponse:
    response = await app_state(raw_request).serving_tokenization.detokenize(request)
    return JSONResponse(response.model_dump())
