"""What the route modules share: the app's state, the handler for an API, and running a
handler that is cancelled when its client goes away."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from fastapi import Request
from fastapi.responses import Response

from minivllm.entrypoints.openai.errors import BadRequestError

logger = logging.getLogger(__name__)

# Status for a request whose client went away (nginx's "client closed request"); nobody
# reads it.
CLIENT_CLOSED_REQUEST = 499


# Where a many-model server's middleware puts the state of the request's model.
MODEL_STATE_KEY = "minivllm.model_state"


def app_state(raw_request: Request):
    """The app's state (app_state.init_app_state fills it): engine, models, handlers; on a
    many-model server, those of the model the request names."""
    return raw_request.scope.get(MODEL_STATE_KEY) or raw_request.app.state


def handler_for(raw_request: Request, name: str, api: str):
    """The state's handler for an API, or vLLM's 400 when the model's runner lacks it (a
    pooling model generates nothing; a generative one gives no embeddings)."""
    handler = getattr(app_state(raw_request), name)
    if handler is None:
        raise BadRequestError(f"The model does not support {api} API")
    return handler


async def wait_for_disconnect(raw_request: Request) -> None:
    while True:
        message = await raw_request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_unless_disconnected(raw_request: Request, handler) -> Response:
    """Run a handler; cancel it (which aborts its engine requests) if the client leaves.

    A streaming handler returns at once; its response then watches the connection itself.
    """
    task = asyncio.ensure_future(handler)
    watcher = asyncio.ensure_future(wait_for_disconnect(raw_request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
    if task.cancelled():
        logger.info("The client disconnected; its request was aborted.")
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return task.result()
