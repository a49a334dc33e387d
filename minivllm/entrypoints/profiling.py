"""The servers' profiler routes, as vLLM's: POST /start_profile and /stop_profile.

They exist only while a trace folder is set (VLLM_TORCH_PROFILER_DIR or
MINIVLLM_TORCH_PROFILER_DIR), as in vLLM; each calls the engine's start_profile() /
stop_profile(), which trace the engine core process.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import Response

from minivllm import envs

logger = logging.getLogger(__name__)


def add_profile_routes(app: FastAPI) -> None:
    """Add the two routes to app when profiling is on; they call app.state.engine (an
    AsyncLLM)."""
    if envs.MINIVLLM_TORCH_PROFILER_DIR is None:
        return
    logger.warning(
        "Profiler routes are on (POST /start_profile, /stop_profile); traces go to %s. "
        "Do not leave this on in production.",
        envs.MINIVLLM_TORCH_PROFILER_DIR,
    )

    @app.post("/start_profile")
    async def start_profile(raw_request: Request) -> Response:
        await raw_request.app.state.engine.start_profile()
        return Response(status_code=200)

    @app.post("/stop_profile")
    async def stop_profile(raw_request: Request) -> Response:
        await raw_request.app.state.engine.stop_profile()
        return Response(status_code=200)
