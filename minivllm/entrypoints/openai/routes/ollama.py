"""Ollama's API: /api/chat, /api/generate (NDJSON streams by default), /api/embed and the
older /api/embeddings, /api/tags, /api/ps, /api/show, /api/version; errors as Ollama's
{"error": message}."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import Any

import pydantic
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

import minivllm
from minivllm.entrypoints.ollama.model_info import describe
from minivllm.entrypoints.ollama.protocol import (
    ChatRequest,
    EmbedRequest,
    GenerateRequest,
    LegacyEmbeddingRequest,
    OllamaModel,
    ShowRequest,
)
from minivllm.entrypoints.ollama.translate import (
    OllamaRequestError,
    chat_body,
    completion_body,
    final_fields,
    generate_messages,
    now,
    tool_calls,
)
from minivllm.entrypoints.openai.errors import (
    ErrorResponse,
    OpenAIServingError,
    describe_validation_errors,
)
from minivllm.entrypoints.openai.model_catalog import estimated_weight_bytes
from minivllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingCompletionRequest,
)
from minivllm.entrypoints.openai.routes.common import app_state, run_unless_disconnected
from minivllm.entrypoints.openai.sse import sse_data

router = APIRouter()
# What /api/version answers: the Ollama API version whose routes and fields this follows.
OLLAMA_API_VERSION = "0.12.0"


def ollama_error(status: int, message: str) -> JSONResponse:
    return ErrorResponse({"error": message}, status_code=status)


async def _answer(raw_request: Request, work) -> Response:
    try:
        return await run_unless_disconnected(raw_request, work)
    except OpenAIServingError as exc:
        return ollama_error(int(exc.status), exc.message)
    except pydantic.ValidationError as exc:
        return ollama_error(HTTPStatus.BAD_REQUEST, describe_validation_errors(exc.errors())[0])
    except OllamaRequestError as exc:
        return ollama_error(HTTPStatus.BAD_REQUEST, str(exc))


async def _json_body(raw_request: Request, kind: type[OllamaModel]) -> dict[str, Any]:
    """The body, checked against the route's model: the fields set, typed (a wrong type is
    a 400 here, never an error deep in the translation)."""
    try:
        body = json.loads(await raw_request.body() or b"{}")
    except ValueError:
        raise OllamaRequestError("invalid JSON in the request body") from None
    if not isinstance(body, dict):
        raise OllamaRequestError("the request body must be a JSON object")
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise OllamaRequestError("model is required")
    return kind.model_validate(body).model_dump(exclude_unset=True)


async def _ndjson(
    chunks: AsyncIterator[dict[str, Any]], model: str, key: str, started: float
) -> AsyncIterator[str]:
    """Chat or completion chunks as Ollama's stream: one object per piece of text (under
    `message` for chat, `response` for generate), tool calls whole, then the final object."""
    calls: dict[int, dict[str, Any]] = {}
    usage, finish = {}, None

    def piece(text: str = "", thinking: str | None = None, calls_done=None) -> str:
        if key == "message":
            body: dict[str, Any] = {"role": "assistant", "content": text}
            if thinking:
                body["thinking"] = thinking
            if calls_done:
                body["tool_calls"] = calls_done
        else:
            body = text
        out = {"model": model, "created_at": now(), key: body, "done": False}
        if key == "response" and thinking:
            out["thinking"] = thinking
        return json.dumps(out) + "\n"

    async for chunk in chunks:
        if "error" in chunk:
            yield json.dumps({"error": chunk["error"].get("message", "error")}) + "\n"
            return
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            text = delta.get("content") or choice.get("text") or ""
            if text or delta.get("reasoning_content"):
                yield piece(text, delta.get("reasoning_content"))
            for call in delta.get("tool_calls") or []:
                entry = calls.setdefault(call["index"], {"function": {"name": "", "arguments": ""}})
                function = call.get("function") or {}
                entry["function"]["name"] += function.get("name") or ""
                entry["function"]["arguments"] += function.get("arguments") or ""
            finish = choice.get("finish_reason") or finish
    if calls:
        yield piece(calls_done=tool_calls([calls[i] for i in sorted(calls)]))
    last = final_fields(model, started, usage, finish)
    last[key] = {"role": "assistant", "content": ""} if key == "message" else ""
    yield json.dumps(last) + "\n"


async def _generate(raw_request: Request, body: dict[str, Any], messages, key: str) -> Response:
    """Run a chat (messages) or raw completion (None) and answer in Ollama's shape."""
    state = app_state(raw_request)
    started = time.monotonic()
    model = body["model"]
    if messages is None:
        if state.serving_completion is None:
            raise OpenAIServingError("the model does not generate text")
        request = CompletionRequest.model_validate(completion_body(body))
        response = await state.serving_completion.create_completion(request, raw_request)
    else:
        handler = state.serving_chat
        if handler is None:
            raise OpenAIServingError("the model does not generate text")
        request = ChatCompletionRequest.model_validate(
            chat_body(body, messages, handler.parses_tool_calls)
        )
        request._max_tokens_is_a_ceiling = True  # num_predict: at most, as Ollama reads it
        response = await handler.create_chat_completion(request, raw_request)
    if request.stream:
        lines = _ndjson(sse_data(response.body_iterator), model, key, started)
        return StreamingResponse(lines, media_type="application/x-ndjson")
    answer = json.loads(response.body)
    if response.status_code != HTTPStatus.OK:
        return ollama_error(response.status_code, answer.get("error", {}).get("message", ""))
    choice = answer["choices"][0]
    out = final_fields(model, started, answer.get("usage") or {}, choice.get("finish_reason"))
    if key == "message":
        reply = choice["message"]
        message: dict[str, Any] = {"role": "assistant", "content": reply.get("content") or ""}
        if reply.get("reasoning_content"):
            message["thinking"] = reply["reasoning_content"]
        if reply.get("tool_calls"):
            message["tool_calls"] = tool_calls(reply["tool_calls"])
        out["message"] = message
    else:
        reply = choice.get("message") or {}
        out["response"] = reply.get("content") if "message" in choice else choice.get("text", "")
        if reply.get("reasoning_content"):
            out["thinking"] = reply["reasoning_content"]
    return JSONResponse(out)


@router.post("/api/chat")
async def chat(raw_request: Request) -> Response:
    async def work() -> Response:
        body = await _json_body(raw_request, ChatRequest)
        messages = body.get("messages") or []
        if not messages:  # Ollama loads the model and answers done
            return JSONResponse({**_loaded(body), "message": {"role": "assistant", "content": ""}})
        return await _generate(raw_request, body, messages, "message")

    return await _answer(raw_request, work())


@router.post("/api/generate")
async def generate(raw_request: Request) -> Response:
    async def work() -> Response:
        body = await _json_body(raw_request, GenerateRequest)
        if not any(body.get(k) for k in ("prompt", "system", "suffix")):
            return JSONResponse({**_loaded(body), "response": ""})
        raw = body.get("raw") or body.get("suffix")  # a suffix: the model fills in between
        messages = None if raw else generate_messages(body)
        return await _generate(raw_request, body, messages, "response")

    return await _answer(raw_request, work())


def _loaded(body: dict[str, Any]) -> dict[str, Any]:
    return {"model": body["model"], "created_at": now(), "done": True, "done_reason": "load"}


@router.post("/api/embed")
async def embed(raw_request: Request) -> Response:
    async def work() -> Response:
        body = await _json_body(raw_request, EmbedRequest)
        inputs = body.get("input", "")
        inputs = [inputs] if isinstance(inputs, str) else inputs
        if not any(inputs):  # Ollama loads the model and answers no embeddings
            return JSONResponse({"model": body["model"], "embeddings": []})
        answer = await _embeddings(raw_request, body, inputs, body.get("truncate", True), None)
        if isinstance(answer, Response):
            return answer
        return JSONResponse(
            {
                "model": body["model"],
                "embeddings": [item["embedding"] for item in answer["data"]],
                "prompt_eval_count": (answer.get("usage") or {}).get("prompt_tokens", 0),
            }
        )

    return await _answer(raw_request, work())


@router.post("/api/embeddings")
async def legacy_embeddings(raw_request: Request) -> Response:
    """Ollama's first embeddings route: one prompt, its vector not normalized (as Ollama's)."""

    async def work() -> Response:
        body = await _json_body(raw_request, LegacyEmbeddingRequest)
        if not body.get("prompt"):  # Ollama loads the model and answers an empty vector
            return JSONResponse({"embedding": []})
        answer = await _embeddings(raw_request, body, [body["prompt"]], True, False)
        if isinstance(answer, Response):
            return answer
        return JSONResponse({"embedding": answer["data"][0]["embedding"]})

    return await _answer(raw_request, work())


async def _embeddings(
    raw_request: Request,
    body: dict[str, Any],
    inputs: list[str],
    truncate: bool,
    normalize: bool | None,
) -> dict[str, Any] | Response:
    """The embeddings route's answer for the texts (or Ollama's error). truncate, Ollama's
    default: a text longer than the model's context keeps its first tokens, as Ollama cuts
    it (vLLM's truncate_prompt_tokens keeps the last); false leaves it the engine's 400."""
    handler = app_state(raw_request).serving_embedding
    if handler is None:
        raise OpenAIServingError("the model does not support embeddings")
    fields: dict[str, Any] = {"model": body["model"], "input": inputs}
    if truncate:
        limit = handler.max_model_len
        fields["input"] = [
            (await handler.encode_async(text, True, param="input", check_length=False))[:limit]
            for text in inputs
        ]
    if body.get("dimensions") is not None:
        fields["dimensions"] = body["dimensions"]
    if normalize is not None:
        fields["normalize"] = normalize
    request = EmbeddingCompletionRequest.model_validate(fields)
    response = await handler.create_embedding(request, raw_request)
    answer = json.loads(response.body)
    if response.status_code != HTTPStatus.OK:
        return ollama_error(response.status_code, answer.get("error", {}).get("message", ""))
    return answer


def _model_entries(raw_request: Request, running: bool) -> list[dict[str, Any]]:
    """Each served name as Ollama lists a model: its file's format and its size, as Ollama's
    /api/tags on disk (the weights' memory where the files are not local) and /api/ps in
    memory (the weights and the KV cache)."""
    state = app_state(raw_request)
    config = state.engine.vllm_config
    weights = int(getattr(state.engine.engine_core, "weight_memory_bytes", 0) or 0)
    if running:
        size = weights + int(config.cache_config.kv_cache_memory_bytes or 0)
    else:
        size = estimated_weight_bytes(config.model_config.model) or weights
    details, _ = describe(config.model_config)
    return [
        {"name": name, "model": name, "modified_at": now(), "size": size, "digest": "",
         "details": details}
        for name in state.models.names
    ]  # fmt: skip


@router.get("/api/tags")
async def tags(raw_request: Request) -> JSONResponse:
    if (models := _many_models(raw_request, running=False)) is not None:
        return JSONResponse({"models": models})
    return JSONResponse({"models": _model_entries(raw_request, running=False)})


def _many_models(raw_request: Request, running: bool) -> list[dict[str, Any]] | None:
    """A many-model server's models (those with an engine, for /api/ps); None: one model."""
    model_router = getattr(app_state(raw_request), "model_router", None)
    if model_router is None:
        return None
    from minivllm.entrypoints.openai.many_models_server import ollama_models

    return ollama_models(model_router, running)


@router.get("/api/ps")
async def ps(raw_request: Request) -> JSONResponse:
    if (models := _many_models(raw_request, running=True)) is not None:
        return JSONResponse({"models": models})
    # A model stays loaded as long as the server runs (Ollama's keep_alive -1).
    forever = "9999-12-31T23:59:59Z"
    entries = _model_entries(raw_request, running=True)
    models = [{**m, "expires_at": forever, "size_vram": 0} for m in entries]
    return JSONResponse({"models": models})


@router.post("/api/show")
async def show(raw_request: Request) -> Response:
    async def work() -> Response:
        body = await _json_body(raw_request, ShowRequest)
        state = app_state(raw_request)
        model_router = getattr(state, "model_router", None)
        if model_router is not None:  # a many-model server's model not loaded: its config
            return JSONResponse(await model_router.describe(body["model"]))
        state.models.resolve(body["model"])  # a 404 for a model not served
        capabilities = ["embedding"] if state.serving_embedding else ["completion"]
        if getattr(state.serving_completion, "fill_in_middle", None) is not None:
            capabilities.append("insert")  # Ollama's name for fill in the middle
        if state.serving_chat is not None and state.serving_chat.tool_parser_cls is not None:
            capabilities.append("tools")
        template = getattr(state.serving_chat, "chat_template", None)
        return JSONResponse(
            show_body(state.engine.vllm_config.model_config, capabilities, template)
        )

    return await _answer(raw_request, work())


def show_body(config, capabilities: list[str], template: str | None) -> dict[str, Any]:
    """/api/show's answer for a model with this ModelConfig."""
    details, model_info = describe(config)
    return {
        "modelfile": "",
        "parameters": "",
        "template": template or "",
        "details": details,
        "model_info": model_info,
        "capabilities": capabilities,
        "modified_at": now(),
    }


@router.get("/api/version")
async def version() -> JSONResponse:
    return JSONResponse({"version": OLLAMA_API_VERSION, "minivllm": minivllm.__version__})
