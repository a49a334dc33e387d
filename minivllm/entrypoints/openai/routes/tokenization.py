"""vLLM's /tokenize and /detokenize, and GET /tokenizer_info (its own router: the server adds
it only with --enable-tokenizer-info-endpoint, as vLLM)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from minivllm.entrypoints.openai import protocol
from minivllm.entrypoints.openai.routes.common import app_state

router = APIRouter()
tokenizer_info_router = APIRouter()


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


@tokenizer_info_router.get("/tokenizer_info")
async def get_tokenizer_info(raw_request: Request) -> JSONResponse:
    return JSONResponse(app_state(raw_request).serving_tokenization.get_tokenizer_info())
