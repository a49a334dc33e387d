"""Responses API bodies to chat completions requests, and chat answers to response objects.

`input` (a string or items: messages, function_call, function_call_output, reasoning)
and `instructions` become chat messages after those of `previous_response_id`; function
tools (also those grouped in a namespace) and `tool_choice` become the chat API's, hosted
tools are left out; `text.format` its response_format;
`max_output_tokens` its max_tokens. The answer's reasoning, text and tool calls become
output items.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any

logger = logging.getLogger(__name__)


class ResponsesRequestError(ValueError):
    """A body the Responses API refuses (a 400 naming the parameter)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ResponsesRequestError("a message's content must be text or a list", "input")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
            raise ResponsesRequestError(f"content of type {kind!r} is not supported", "input")
        parts.append(part.get("text", ""))
    return "".join(parts)


def input_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The request's `input` as chat messages (without instructions)."""
    items = body.get("input")
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise ResponsesRequestError("input must be a string or a non-empty list", "input")
    messages: list[dict[str, Any]] = []
    for item in items:
        if not isinstance(item, dict):
            raise ResponsesRequestError("each input item must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ResponsesRequestError(f"unknown role {role!r}", "input")
            role = "system" if role == "developer" else role
            messages.append({"role": role, "content": _text_of(item.get("content", ""))})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "")},
            }
            if messages and messages[-1]["role"] == "assistant" and not messages[-1]["content"]:
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output", "")
            output = output if isinstance(output, str) else _text_of(output)
            messages.append(
                {"role": "tool", "tool_call_id": item.get("call_id"), "content": output}
            )
        elif kind == "reasoning":
            continue  # earlier reasoning is not shown to the model again, as chat does
        else:
            raise ResponsesRequestError(f"input items of type {kind!r} are not supported", "input")
    return messages


def _function_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The function tools, those of a namespace (a named group of them, as Codex sends its
    sub-agent tools) included. Hosted tools (web_search, file_search, code_interpreter,
    mcp, ...) are the provider's to run and a local server runs none: they are left out of
    what the model sees, as other local servers do, so that a client that always offers
    one (Codex offers web_search) still gets an answer."""
    found = []
    for tool in tools:
        if tool.get("type") == "function":
            found.append(tool)
        elif tool.get("type") == "namespace":
            found += _function_tools(tool.get("tools") or [])
        else:
            logger.debug("Leaving out a hosted tool of type %r", tool.get("type"))
    return found


def _tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    out = []
    for tool in _function_tools(body.get("tools") or []):
        function = {"name": tool.get("name"), "parameters": tool.get("parameters") or {}}
        if tool.get("description"):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out or None


def _tool_choice(body: dict[str, Any], auto_tools: bool) -> Any:
    choice = body.get("tool_choice", "auto")
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise ResponsesRequestError("tool_choice must name a function tool", "tool_choice")
        return {"type": "function", "function": {"name": choice.get("name")}}
    if choice == "auto" and not auto_tools:
        return "none"  # the template shows the tools; the reply stays text
    return choice


def _response_format(body: dict[str, Any]) -> dict[str, Any] | None:
    fmt = ((body.get("text") or {}).get("format")) or {}
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {"name": fmt.get("name", "schema"), "schema": fmt.get("schema") or {}}
        return {"type": "json_schema", "json_schema": schema}
    raise ResponsesRequestError(f"text.format of type {kind!r} is not supported", "text")


def chat_body(
    body: dict[str, Any], history: list[dict[str, Any]], auto_tools: bool
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The chat completions body, and the conversation it sends (stored with the answer)."""
    conversation = list(history) + input_messages(body)
    messages = list(conversation)
    if body.get("instructions"):  # not carried over by previous_response_id, as OpenAI's
        messages.insert(0, {"role": "system", "content": str(body["instructions"])})
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    for ours, theirs in (
        ("max_tokens", "max_output_tokens"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("parallel_tool_calls", "parallel_tool_calls"),
    ):
        if body.get(theirs) is not None:
            chat[ours] = body[theirs]
    tools = _tools(body)
    if tools:
        chat["tools"] = tools
        chat["tool_choice"] = _tool_choice(body, auto_tools)
    fmt = _response_format(body)
    if fmt is not None:
        chat["response_format"] = fmt
    effort = (body.get("reasoning") or {}).get("effort")
    if effort is not None:
        chat["chat_template_kwargs"] = {"reasoning_effort": effort}
    if body.get("stream"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return chat, conversation


def output_items(
    reasoning: str | None, text: str | None, calls: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    if reasoning:
        items.append(reasoning_item(reasoning))
    if text or not (reasoning or calls):
        items.append(message_item(text or ""))
    items.extend(function_call_item(c["id"], c["name"], c["arguments"]) for c in calls)
    return items


def reasoning_item(text: str, item_id: str | None = None) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": item_id or new_id("rs"),
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": "completed",
    }


def message_item(text: str, item_id: str | None = None, status: str = "completed") -> dict:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {
        "type": "message",
        "id": item_id or new_id("msg"),
        "role": "assistant",
        "status": status,
        "content": content,
    }


def function_call_item(call_id: str, name: str, arguments: str, item_id: str | None = None):
    return {
        "type": "function_call",
        "id": item_id or new_id("fc"),
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": "completed",
    }


def response_object(
    body: dict[str, Any],
    response_id: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
    status: str = "completed",
    finish: str | None = None,
) -> dict[str, Any]:
    usage = usage or {}
    incomplete = {"reason": "max_output_tokens"} if finish == "length" else None
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "incomplete" if incomplete and status == "completed" else status,
        "model": body.get("model"),
        "output": output,
        "instructions": body.get("instructions"),
        "tools": body.get("tools") or [],
        "tool_choice": body.get("tool_choice", "auto"),
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "max_output_tokens": body.get("max_output_tokens"),
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": body.get("reasoning"),
        "text": body.get("text") or {"format": {"type": "text"}},
        "metadata": body.get("metadata") or {},
        "store": body.get("store", True),
        "incomplete_details": incomplete,
        "error": None,
        "usage": {
            "input_tokens": usage.get("prompt_tokens", 0),
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": usage.get("completion_tokens") or 0,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.get("total_tokens", 0),
        },
    }


def assistant_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The output items as the chat messages that continue the conversation."""
    text = "".join(
        part["text"] for item in output if item["type"] == "message" for part in item["content"]
    )
    calls = [
        {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }
        for item in output
        if item["type"] == "function_call"
    ]
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    return [message]


def json_arguments(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments)
