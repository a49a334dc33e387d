"""OpenAI's Responses API: POST /v1/responses (whole or streamed), GET and DELETE
/v1/responses/{id} of stored ones, and POST /v1/responses/{id}/cancel."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import Any

import pydantic
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from minivllm.entrypoints.openai.errors import (
    BadRequestError,
    NotFoundError,
    describe_validation_errors,
)
from minivllm.entrypoints.openai.protocol import ChatCompletionRequest
from minivllm.entrypoints.openai.routes.common import app_state, run_unless_disconnected
from minivllm.entrypoints.openai.sse import SSEResponse, sse_data
from minivllm.entrypoints.responses.protocol import ResponsesRequest
from minivllm.entrypoints.responses.store import ResponseStore
from minivllm.entrypoints.responses.stream import ResponseEventStream
from minivllm.entrypoints.responses.translate import (
    ResponsesRequestError,
    assistant_messages,
    chat_body,
    new_id,
    output_items,
    response_object,
)

router = APIRouter()


def _store(raw_request: Request) -> ResponseStore:
    state = app_state(raw_request)
    if getattr(state, "response_store", None) is None:
        state.response_store = ResponseStore()
    return state.response_store


async def _create(raw_request: Request) -> Response:
    try:
        body = json.loads(await raw_request.body())
    except ValueError:
        raise BadRequestError("The request body is not valid JSON.") from None
    if not isinstance(body, dict):
        raise BadRequestError("The request body must be a JSON object.")
    try:
        body = ResponsesRequest.model_validate(body).body()
    except pydantic.ValidationError as exc:
        raise BadRequestError(*describe_validation_errors(exc.errors())) from None
    handler = app_state(raw_request).serving_chat
    if handler is None:
        raise BadRequestError("The model does not support Responses API")
    store = _store(raw_request)
    history: list[dict[str, Any]] = []
    if body.get("previous_response_id"):
        found = store.get(str(body["previous_response_id"]))
        if found is None:
            raise NotFoundError(
                f"Response with id '{body['previous_response_id']}' not found: it was never "
                "stored or has been dropped from the server's bounded store.",
                param="previous_response_id",
            )
        history = found[1]
    try:
        chat, conversation = chat_body(body, history, handler.parses_tool_calls)
        request = ChatCompletionRequest.model_validate(chat)
    except ResponsesRequestError as exc:
        raise BadRequestError(str(exc), param=exc.param) from None
    except pydantic.ValidationError as exc:
        raise BadRequestError(*describe_validation_errors(exc.errors())) from None
    response_id = new_id("resp")
    answer = await handler.create_chat_completion(request, raw_request)

    def make(output, usage, status, finish) -> dict[str, Any]:
        return response_object(body, response_id, output, usage, status, finish)

    def keep(final: dict[str, Any]) -> None:
        if body.get("store", True):
            store.put(final, conversation + assistant_messages(final["output"]))

    if request.stream:
        events = ResponseEventStream(make)

        async def stream() -> AsyncIterator[str]:
            async for event in events.events(sse_data(answer.body_iterator)):
                yield event
            if hasattr(events, "final"):
                keep(events.final)

        return SSEResponse(stream())
    chat_answer = json.loads(answer.body)
    if answer.status_code != HTTPStatus.OK:
        return JSONResponse(chat_answer, status_code=answer.status_code)
    choice = chat_answer["choices"][0]
    reply = choice["message"]
    calls = [
        {"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
        for c in reply.get("tool_calls") or []
    ]
    output = output_items(reply.get("reasoning_content"), reply.get("content"), calls)
    final = make(output, chat_answer.get("usage"), "completed", choice.get("finish_reason"))
    keep(final)
    return JSONResponse(final)


@router.post("/v1/responses")
async def create_response(raw_request: Request) -> Response:
    return await run_unless_disconnected(raw_request, _create(raw_request))


def _stored(raw_request: Request, response_id: str) -> dict[str, Any]:
    found = _store(raw_request).get(response_id)
    if found is None:
        raise NotFoundError(f"Response with id '{response_id}' not found.")
    return found[0]


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, raw_request: Request) -> JSONResponse:
    return JSONResponse(_stored(raw_request, response_id))


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, raw_request: Request) -> JSONResponse:
    _stored(raw_request, response_id)
    _store(raw_request).pop(response_id)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, raw_request: Request) -> JSONResponse:
    # Responses here finish before they are stored (no `background` mode): one that can be
    # found is complete, and cancelling it is refused, as OpenAI refuses it.
    _stored(raw_request, response_id)
    raise BadRequestError("Only a background response in progress can be cancelled.")
