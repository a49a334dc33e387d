"""Server-sent events: the streaming responses' body format, and a response that always
closes its generator (so a client that goes away aborts its request at once)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from minivllm.entrypoints.openai.errors import error_body, to_error
from minivllm.entrypoints.openai.output_streams import usage


def sse_event(data: str) -> str:
    return f"data: {data}\n\n"


def chunk_event(chunk: BaseModel) -> str:
    """A stream chunk as an event: every field, but `usage` only on chunks that carry it."""
    exclude = {"usage"} if getattr(chunk, "usage", None) is None else None
    return sse_event(chunk.model_dump_json(exclude=exclude))


def error_event(exc: BaseException) -> str:
    """What a stream says when it fails after it started: the error body as an event."""
    error = to_error(exc)
    return sse_event(json.dumps(error_body(error.status, error.message, error.param)))


def chunk_maker(
    chunk_type: type[BaseModel], request_id: str, model_name: str, num_prompt_tokens: int
) -> Callable[..., BaseModel]:
    """make_chunk(choices, num_completion_tokens=None) for one stream: its chunks share id,
    creation time and model; usage when num_completion_tokens is given."""
    created = int(time.time())

    def make_chunk(choices: list, num_completion_tokens: int | None = None) -> BaseModel:
        chunk = chunk_type(id=request_id, created=created, model=model_name, choices=choices)
        if num_completion_tokens is not None:
            chunk.usage = usage(num_prompt_tokens, num_completion_tokens)
        return chunk

    return make_chunk


async def sse_data(body: AsyncIterator[str]) -> AsyncIterator[dict[str, Any]]:
    """The JSON objects of an event stream's `data:` lines (without the final [DONE]): how
    the other APIs read the chat API's stream to translate it."""
    async for raw in body:
        for line in raw.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[len("data: ") :])


class SSEResponse(StreamingResponse):
    """A text/event-stream response whose body generator is closed however the response
    ends: finished, failed, or cancelled because the client disconnected."""

    media_type = "text/event-stream"

    def __init__(self, content, **kwargs) -> None:
        headers = {"Cache-Control": "no-cache", **kwargs.pop("headers", {})}
        super().__init__(content, headers=headers, **kwargs)

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
