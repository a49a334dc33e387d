"""Runtime LoRA routes: /v1/load_lora_adapter and /v1/unload_lora_adapter, on only with
MINIVLLM_ALLOW_RUNTIME_LORA_UPDATING (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING) and
--enable-lora."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

from minivllm import envs
from minivllm.entrypoints.openai.errors import BadRequestError, NotFoundError
from minivllm.entrypoints.openai.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from minivllm.entrypoints.openai.routes.common import app_state
from minivllm.entrypoints.openai.serving_models import ServedModels

router = APIRouter()


def _runtime_lora(raw_request: Request) -> ServedModels:
    """The served models, where adapters may be loaded now (vLLM's switch and flag)."""
    if not envs.MINIVLLM_ALLOW_RUNTIME_LORA_UPDATING:
        raise NotFoundError("Not Found")  # the routes are off, as vLLM leaves them out
    state = app_state(raw_request)
    if state.engine.vllm_config.lora_config is None:
        raise BadRequestError("LoRA is not enabled: start the server with --enable-lora.")
    return state.models


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: LoadLoRAAdapterRequest, raw_request: Request) -> Response:
    models = _runtime_lora(raw_request)
    engine = app_state(raw_request).engine
    await models.load_lora_adapter(engine, request.lora_name, request.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: UnloadLoRAAdapterRequest, raw_request: Request) -> Response:
    _runtime_lora(raw_request).unload_lora_adapter(request.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' removed successfully.")
