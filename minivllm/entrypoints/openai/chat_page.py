"""The chat page at `/` of `minivllm serve`: static files shipped in the package (static/),
served as they are. The page talks to the server's own /v1/chat/completions;
`--disable-chat-page` leaves it out for API-only deployments."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).parent / "static"


def mount_chat_page(app: FastAPI) -> None:
    """`/` answers the page; `/static/...` its scripts and styles."""
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    @app.get("/", include_in_schema=False)
    async def chat_page() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html")
