"""Server-sent events: the streaming responses' body format, and a response that always
closes its generator (so a client that goes away aborts its request at once)."""

from __future__ import annotations

from fastapi.responses import StreamingResponse
from pydantic import BaseModel


def sse_event(data: str) -> str:
    return f"data: {data}\n\n"


def chunk_event(chunk: BaseModel) -> str:
    """A stream chunk as an event: every field, but `usage` only on chunks that carry it."""
    exclude = {"usage"} if getattr(chunk, "usage", None) is None else None
    return sse_event(chunk.model_dump_json(exclude=exclude))


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
