"""Anthropic's Messages API: /v1/messages and /v1/messages/count_tokens, errors in its shape."""

from __future__ import annotations

import json
from http import HTTPStatus

import pydantic
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from minivllm.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest, error_body
from minivllm.entrypoints.anthropic.serving_messages import (
    MessageStream,
    count_tokens_request,
    to_chat_request,
    to_message,
)
from minivllm.entrypoints.openai.errors import ErrorResponse, OpenAIServingError
from minivllm.entrypoints.openai.routes.common import app_state, run_unless_disconnected
from minivllm.entrypoints.openai.sse import SSEResponse, sse_data

router = APIRouter()


def anthropic_error(status: int, message: str) -> JSONResponse:
    return ErrorResponse(error_body(status, message), status_code=status)


async def _body(raw_request: Request, model: type[pydantic.BaseModel]):
    try:
        return model.model_validate(json.loads(await raw_request.body()))
    except ValueError as exc:  # malformed JSON or pydantic's ValidationError
        errors = getattr(exc, "errors", None)
        detail = (
            "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in errors())
            if errors
            else str(exc)
        )
        raise OpenAIServingError(f"Invalid request: {detail}") from None


async def _answer(raw_request: Request, work) -> Response:
    try:
        return await run_unless_disconnected(raw_request, work)
    except OpenAIServingError as exc:
        return anthropic_error(int(exc.status), exc.message)


@router.post("/v1/messages")
async def create_message(raw_request: Request) -> Response:
    async def work() -> Response:
        request = await _body(raw_request, MessagesRequest)
        chat_handler = app_state(raw_request).serving_chat
        if chat_handler is None:
            raise OpenAIServingError("The model does not support the Messages API")
        try:
            chat = to_chat_request(request, chat_handler.parses_tool_calls)
        except pydantic.ValidationError as exc:
            raise OpenAIServingError(f"Invalid request: {exc.errors()[0]['msg']}") from None
        response = await chat_handler.create_chat_completion(chat, raw_request)
        if request.stream:
            return SSEResponse(MessageStream(request).events(sse_data(response.body_iterator)))
        body = json.loads(response.body)
        if response.status_code != HTTPStatus.OK:
            message = body.get("error", {}).get("message", "request failed")
            return anthropic_error(response.status_code, message)
        return JSONResponse(to_message(body, request))

    return await _answer(raw_request, work())


@router.post("/v1/messages/count_tokens")
async def count_tokens(raw_request: Request) -> Response:
    async def work() -> Response:
        request = await _body(raw_request, CountTokensRequest)
        counted = await app_state(raw_request).serving_tokenization.tokenize(
            count_tokens_request(request)
        )
        return JSONResponse({"input_tokens": counted.count})

    return await _answer(raw_request, work())
