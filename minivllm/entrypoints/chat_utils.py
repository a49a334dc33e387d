"""Chat messages as chat templates expect them, for LLM.chat (vLLM's module of this name):
a content given as OpenAI's list of parts becomes one string, and tool call arguments
given as JSON text become objects, as the server renders them (protocol.to_template_dict)."""

from __future__ import annotations

import json
from typing import Any

# vLLM's chat_template_content_format values: "string" (and "auto", which resolves to it
# here: HF templates print a list content as its Python repr) or "openai" (parts as given).
CONTENT_FORMATS = ("auto", "string", "openai")


def template_messages(conversation: list[dict], content_format: str = "auto") -> list[dict]:
    if content_format not in CONTENT_FORMATS:
        raise ValueError(
            f"chat_template_content_format must be one of {', '.join(CONTENT_FORMATS)}, got "
            f"{content_format!r}."
        )
    if not isinstance(conversation, list) or not all(isinstance(m, dict) for m in conversation):
        raise ValueError("A conversation must be a list of message dicts.")
    return [_template_message(m, content_format) for m in conversation]


def _template_message(message: dict, content_format: str) -> dict[str, Any]:
    message = dict(message)
    content = message.get("content")
    if isinstance(content, list) and content_format != "openai":
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(
                    f"Content parts of type {kind!r} are not supported: this engine serves "
                    "text-only models."
                )
            texts.append(str(part.get("text", "")))
        message["content"] = "\n".join(texts)
    calls = message.get("tool_calls")
    if isinstance(calls, list):
        message["tool_calls"] = [_call_with_object_arguments(call) for call in calls]
    return message


def _call_with_object_arguments(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except json.JSONDecodeError:
        return call  # as given: the template shows it as text
    return {**call, "function": {**function, "arguments": arguments}}
