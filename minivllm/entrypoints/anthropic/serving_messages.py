"""POST /v1/messages and /v1/messages/count_tokens: each Anthropic request becomes a chat
completions request (the same chat template, tool and reasoning parsers, structured
outputs and limits), and each chat answer or stream chunk becomes Anthropic's shape."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from minivllm.entrypoints.anthropic.protocol import (
    CountTokensRequest,
    MessageParam,
    MessagesRequest,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from minivllm.entrypoints.openai.protocol import ChatCompletionRequest, TokenizeChatRequest

# The chat API's finish reasons in Anthropic's words.
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def _text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "".join(b.text for b in content)


def chat_messages(request: CountTokensRequest) -> list[dict[str, Any]]:
    """The conversation as chat completions messages: a tool_use block is an assistant's
    tool call, a tool_result block a "tool" message, thinking the reasoning_content."""
    messages: list[dict[str, Any]] = []
    if request.system:
        messages.append({"role": "system", "content": _text(request.system)})
    for message in request.messages:
        messages.extend(_chat_message(message))
    return messages


def _chat_message(message: MessageParam) -> list[dict[str, Any]]:
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    results, text, calls, reasoning = [], [], [], []
    for block in message.content:
        if isinstance(block, ToolResultBlock):
            content = _text(block.content)
            results.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": content})
        elif isinstance(block, ToolUseBlock):
            function = {"name": block.name, "arguments": json.dumps(block.input)}
            calls.append({"id": block.id, "type": "function", "function": function})
        elif isinstance(block, TextBlock):
            text.append(block.text)
        else:
            reasoning.append(block.thinking)
    chat: list[dict[str, Any]] = list(results)  # tool results answer the turn before
    if text or calls or not results:
        turn: dict[str, Any] = {"role": message.role, "content": "".join(text)}
        if calls:
            turn["tool_calls"] = calls
        if reasoning:
            turn["reasoning_content"] = "".join(reasoning)
        chat.append(turn)
    return chat


def _tools(request: CountTokensRequest) -> list[dict[str, Any]] | None:
    if not request.tools:
        return None
    return [
        {
            "type": "function",
            "function": {
                "name": t.name,
                "description": t.description or "",
                "parameters": t.input_schema,
            },
        }
        for t in request.tools
    ]


def _template_kwargs(request: CountTokensRequest) -> dict[str, Any] | None:
    if request.thinking is None:
        return None
    return {"enable_thinking": request.thinking.type != "disabled"}


def to_chat_request(request: MessagesRequest, auto_tools: bool) -> ChatCompletionRequest:
    """The chat completions request that asks the same. Tools with choice "auto" are
    parsed only where the server parses tool calls (--enable-auto-tool-choice); elsewhere
    the template still shows them and the reply is text, as Anthropic clients expect."""
    body: dict[str, Any] = {
        "model": request.model,
        "messages": chat_messages(request),
        "max_tokens": request.max_tokens,
        "stream": request.stream,
    }
    if request.stream:
        body["stream_options"] = {"include_usage": True}
    for name in ("temperature", "top_p", "top_k"):
        if getattr(request, name) is not None:
            body[name] = getattr(request, name)
    if request.stop_sequences:
        body["stop"] = request.stop_sequences
    tools = _tools(request)
    if tools:
        body["tools"] = tools
        body["tool_choice"] = _tool_choice(request, auto_tools)
        if request.tool_choice is not None and request.tool_choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    if _template_kwargs(request):
        body["chat_template_kwargs"] = _template_kwargs(request)
    chat = ChatCompletionRequest.model_validate(body)
    chat._max_tokens_is_a_ceiling = True  # "the maximum number of tokens to generate"
    return chat


def _tool_choice(request: MessagesRequest, auto_tools: bool) -> Any:
    choice = request.tool_choice.type if request.tool_choice else "auto"
    if choice == "any":
        return "required"
    if choice == "tool":
        return {"type": "function", "function": {"name": request.tool_choice.name}}
    if choice == "auto" and not auto_tools:
        return "none"
    return choice


def count_tokens_request(request: CountTokensRequest) -> TokenizeChatRequest:
    body: dict[str, Any] = {"model": request.model, "messages": chat_messages(request)}
    if _tools(request):
        body["tools"] = _tools(request)
    if _template_kwargs(request):
        body["chat_template_kwargs"] = _template_kwargs(request)
    return TokenizeChatRequest.model_validate(body)


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def _stop(choice: dict[str, Any], stop_sequences: list[str] | None) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence for a chat choice's finish."""
    stopped_by = choice.get("stop_reason")
    if isinstance(stopped_by, str) and stopped_by in (stop_sequences or []):
        return "stop_sequence", stopped_by
    return STOP_REASONS.get(choice.get("finish_reason") or "stop", "end_turn"), None


def to_message(chat: dict[str, Any], request: MessagesRequest) -> dict[str, Any]:
    """A chat completion as an Anthropic message: thinking, text, then tool_use blocks."""
    choice = chat["choices"][0]
    reply = choice["message"]
    content: list[dict[str, Any]] = []
    if reply.get("reasoning_content"):
        content.append(
            {"type": "thinking", "thinking": reply["reasoning_content"], "signature": ""}
        )
    if reply.get("content"):
        content.append({"type": "text", "text": reply["content"]})
    for call in reply.get("tool_calls") or []:
        content.append(
            _tool_use(call["id"], call["function"]["name"], call["function"]["arguments"])
        )
    stop_reason, stop_sequence = _stop(choice, request.stop_sequences)
    usage = chat.get("usage") or {}
    return {
        "id": message_id(),
        "type": "message",
        "role": "assistant",
        "model": request.model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": {
            "input_tokens": usage.get("prompt_tokens", 0),
            "output_tokens": usage.get("completion_tokens") or 0,
        },
    }


def _tool_use(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    try:
        arguments_json = json.loads(arguments) if arguments else {}
    except ValueError:
        arguments_json = {}
    return {"type": "tool_use", "id": call_id, "name": name, "input": arguments_json}


def event(kind: str, data: dict[str, Any]) -> str:
    """One server-sent event as Anthropic streams them: its type named twice."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


class MessageStream:
    """Chat completion chunks in, Anthropic's events out: message_start, then per content
    block a start, its deltas and a stop, then message_delta (stop reason, usage) and
    message_stop. A new kind of delta (reasoning, text, another tool call) closes the
    block before it."""

    def __init__(self, request: MessagesRequest) -> None:
        self.request = request
        self.index = -1
        self.open_kind: str | None = None  # "thinking", "text" or a tool call's index
        self.finish: tuple[str, str | None] = ("end_turn", None)
        self.usage = {"input_tokens": 0, "output_tokens": 0}

    async def events(self, chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
        started = False
        async for chunk in chunks:
            if "error" in chunk:
                yield event("error", {"error": chunk["error"]})
                return
            if not started:
                started = True
                yield self._message_start(chunk)
            for out in self._chunk(chunk):
                yield out
        if not started:
            yield self._message_start({})
        if self.open_kind is not None:
            yield event("content_block_stop", {"index": self.index})
        delta = {"stop_reason": self.finish[0], "stop_sequence": self.finish[1]}
        yield event("message_delta", {"delta": delta, "usage": self.usage})
        yield event("message_stop", {})

    def _message_start(self, chunk: dict[str, Any]) -> str:
        message = {
            "id": message_id(),
            "type": "message",
            "role": "assistant",
            "model": self.request.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }
        return event("message_start", {"message": message})

    def _open(self, kind: str, block: dict[str, Any]) -> list[str]:
        out = []
        if self.open_kind is not None:
            out.append(event("content_block_stop", {"index": self.index}))
        self.index += 1
        self.open_kind = kind
        out.append(event("content_block_start", {"index": self.index, "content_block": block}))
        return out

    def _chunk(self, chunk: dict[str, Any]) -> list[str]:
        out: list[str] = []
        if chunk.get("usage"):
            self.usage = {
                "input_tokens": chunk["usage"].get("prompt_tokens", 0),
                "output_tokens": chunk["usage"].get("completion_tokens") or 0,
            }
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                if self.open_kind != "thinking":
                    out += self._open("thinking", {"type": "thinking", "thinking": ""})
                thinking = {"type": "thinking_delta", "thinking": delta["reasoning_content"]}
                out.append(event("content_block_delta", {"index": self.index, "delta": thinking}))
            if delta.get("content"):
                if self.open_kind != "text":
                    out += self._open("text", {"type": "text", "text": ""})
                text = {"type": "text_delta", "text": delta["content"]}
                out.append(event("content_block_delta", {"index": self.index, "delta": text}))
            for call in delta.get("tool_calls") or []:
                kind = f"tool:{call['index']}"
                function = call.get("function") or {}
                if self.open_kind != kind:
                    block = {
                        "type": "tool_use",
                        "id": call.get("id"),
                        "name": function.get("name"),
                        "input": {},
                    }
                    out += self._open(kind, block)
                if function.get("arguments"):
                    args = {"type": "input_json_delta", "partial_json": function["arguments"]}
                    out.append(event("content_block_delta", {"index": self.index, "delta": args}))
            if choice.get("finish_reason"):
                self.finish = _stop(choice, self.request.stop_sequences)
        return out
