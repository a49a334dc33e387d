"""The server's routes: one module per API family, each with one APIRouter."""

# A new API (another vendor's, a router over models) is one more module here and one line in
# ROUTERS.

from __future__ import annotations

from fastapi import APIRouter

from minivllm.entrypoints.openai.routes import (
    admin,
    completions,
    lora,
    messages,
    models,
    ollama,
    pooling,
    responses,
    tokenization,
)

ROUTERS: tuple[APIRouter, ...] = (
    admin.router,
    completions.router,
    pooling.router,
    tokenization.router,
    lora.router,
    models.router,
    messages.router,
    ollama.router,
    responses.router,
)
