"""Ollama's request bodies to the OpenAI API's requests, and their answers back.

An /api/chat body becomes a chat completions request and /api/generate one too (Ollama
applies the model's template to a prompt; `raw: true` makes it a plain completion), so
both take the chat path's template, tool and reasoning parsers, structured outputs and
limits. `options` carry Ollama's sampling names; `format` is "json" or a JSON schema.
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from typing import Any

# Ollama's `options` -> our sampling fields (the others, num_ctx, num_thread, ..., are about
# its own runtime and are accepted and ignored).
OPTIONS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "stop": "stop",
    "repeat_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}
DONE_REASONS = {"stop": "stop", "length": "length", "tool_calls": "stop"}


class OllamaRequestError(ValueError):
    """A body Ollama's API would refuse: answered {"error": message} with a 400."""


def now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise OllamaRequestError("options must be an object")
    fields = {ours: options[theirs] for theirs, ours in OPTIONS.items() if theirs in options}
    if isinstance(fields.get("stop"), str):
        fields["stop"] = [fields["stop"]]
    predict = options.get("num_predict")
    if isinstance(predict, int) and predict > 0:  # -1 (and -2): until the context is full
        fields["max_tokens"] = predict
    fmt = body.get("format")
    if fmt == "json":
        fields["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        schema = {"name": "format", "schema": fmt}
        fields["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif fmt not in (None, ""):
        raise OllamaRequestError('format must be "json" or a JSON schema')
    return fields


def _chat_message(message: Any) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise OllamaRequestError("each message must be an object")
    if message.get("images"):
        raise OllamaRequestError("images are not supported by this model")
    out: dict[str, Any] = {"role": message.get("role"), "content": message.get("content", "")}
    if message.get("thinking"):
        out["reasoning_content"] = message["thinking"]
    calls = message.get("tool_calls") or []
    if calls:
        out["tool_calls"] = [
            {
                "id": f"call_{i}",
                "type": "function",
                "function": {
                    "name": (call.get("function") or {}).get("name"),
                    "arguments": json.dumps((call.get("function") or {}).get("arguments") or {}),
                },
            }
            for i, call in enumerate(calls)
        ]
    return out


def chat_body(body: dict[str, Any], messages: list[Any], auto_tools: bool) -> dict[str, Any]:
    """The chat completions body for an Ollama chat (or templated generate) request."""
    chat: dict[str, Any] = {
        "model": body.get("model"),
        "messages": [_chat_message(m) for m in messages],
        "stream": body.get("stream", True) is not False,
        **_sampling(body),
    }
    if chat["stream"]:
        chat["stream_options"] = {"include_usage": True}
    if body.get("tools"):
        chat["tools"] = body["tools"]
        # Ollama parses tool calls from every reply; here only where the server parses them.
        chat["tool_choice"] = "auto" if auto_tools else "none"
    if isinstance(body.get("think"), bool):
        chat["chat_template_kwargs"] = {"enable_thinking": body["think"]}
    return chat


def generate_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = []
    if body.get("system"):
        messages.append({"role": "system", "content": body["system"]})
    messages.append({"role": "user", "content": body.get("prompt") or ""})
    return messages


def completion_body(body: dict[str, Any]) -> dict[str, Any]:
    """A raw /api/generate (the prompt as it is, no template), or one with a suffix (the
    middle between prompt and suffix, laid out with the model's FIM tokens)."""
    out = {
        "model": body.get("model"),
        "prompt": body.get("prompt") or "",
        **({"suffix": body["suffix"]} if body.get("suffix") else {}),
        "stream": body.get("stream", True) is not False,
        "max_tokens": None,  # Ollama's default: until the context is full
        **_sampling(body),
    }
    if out["stream"]:
        out["stream_options"] = {"include_usage": True}
    return out


def tool_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI tool calls (arguments as JSON text) as Ollama's (arguments as an object)."""
    out = []
    for call in calls:
        function = call.get("function") or {}
        try:
            arguments = json.loads(function.get("arguments") or "{}")
        except ValueError:
            arguments = {}
        out.append({"function": {"name": function.get("name"), "arguments": arguments}})
    return out


def final_fields(
    model: str, started: float, usage: dict[str, Any], finish: str | None
) -> dict[str, Any]:
    """The last object's fields: done, the reason, the token counts and durations (ns)."""
    total = int((time.monotonic() - started) * 1e9)
    return {
        "model": model,
        "created_at": now(),
        "done": True,
        "done_reason": DONE_REASONS.get(finish or "stop", "stop"),
        "total_duration": total,
        "load_duration": 0,
        "prompt_eval_count": usage.get("prompt_tokens", 0),
        "prompt_eval_duration": 0,
        "eval_count": usage.get("completion_tokens") or 0,
        "eval_duration": total,
    }
