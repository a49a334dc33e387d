"""Chat completion chunks in, the Responses API's stream events out.

response.created and .in_progress; then for each output item, in order, its
output_item.added, its deltas (reasoning_text, output_text after a content_part.added,
or function_call_arguments) and their .done events, and output_item.done; then
response.completed (or .incomplete) with the whole response. A new kind of delta closes
the item before it. Every event carries its sequence_number.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from minivllm.entrypoints.responses.translate import (
    function_call_item,
    message_item,
    new_id,
    reasoning_item,
)


class ResponseEventStream:
    def __init__(self, make_response: Callable[..., dict[str, Any]]) -> None:
        self.make_response = make_response  # (output, usage, status, finish) -> response
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.open: str | None = None  # "reasoning", "message" or "call:<index>"
        self.text = ""
        self.usage: dict[str, Any] = {}
        self.finish: str | None = None

    def _event(self, kind: str, **data: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **data}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    @property
    def _index(self) -> int:
        return len(self.output) - 1

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        item, index, events = self.output[-1], self._index, []
        if self.open == "reasoning":
            item["content"][0]["text"] = self.text
            events.append(
                self._event(
                    "response.reasoning_text.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=self.text,
                )
            )
        elif self.open == "message":
            part = item["content"][0]
            part["text"] = self.text
            events.append(
                self._event(
                    "response.output_text.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=self.text,
                    logprobs=[],
                )
            )
            events.append(
                self._event(
                    "response.content_part.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=part,
                )
            )
        else:
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    arguments=item["arguments"],
                )
            )
        item["status"] = "completed"
        events.append(self._event("response.output_item.done", output_index=index, item=item))
        self.open, self.text = None, ""
        return events

    def _add(self, kind: str, item: dict[str, Any]) -> list[str]:
        events = self._close()
        self.output.append(item)
        self.open = kind
        events.append(
            self._event("response.output_item.added", output_index=self._index, item=item)
        )
        return events

    def _open_message(self) -> list[str]:
        item = message_item("", new_id("msg"), status="in_progress")
        part = item["content"][0]
        item["content"] = []
        events = self._add("message", item)
        item["content"] = [part]
        events.append(
            self._event(
                "response.content_part.added",
                item_id=item["id"],
                output_index=self._index,
                content_index=0,
                part=dict(part),
            )
        )
        return events

    async def events(self, chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
        started = self.make_response([], None, "in_progress", None)
        yield self._event("response.created", response=started)
        yield self._event("response.in_progress", response=started)
        async for chunk in chunks:
            if "error" in chunk:
                failed = self.make_response(self.output, self.usage, "failed", None)
                failed["error"] = {"code": "server_error", "message": str(chunk["error"])}
                yield self._event("response.failed", response=failed)
                return
            for event in self._chunk(chunk):
                yield event
        if not self.output:  # no text, no call: one empty message, as the whole answer has
            for event in self._open_message():
                yield event
        for event in self._close():
            yield event
        final = self.make_response(self.output, self.usage, "completed", self.finish)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        yield self._event(kind, response=final)
        self.final = final

    def _chunk(self, chunk: dict[str, Any]) -> list[str]:
        events: list[str] = []
        self.usage = chunk.get("usage") or self.usage
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                if self.open != "reasoning":
                    item = reasoning_item("", new_id("rs"))
                    item["status"] = "in_progress"
                    events += self._add("reasoning", item)
                self.text += delta["reasoning_content"]
                events.append(
                    self._event(
                        "response.reasoning_text.delta",
                        item_id=self.output[-1]["id"],
                        output_index=self._index,
                        content_index=0,
                        delta=delta["reasoning_content"],
                    )
                )
            if delta.get("content"):
                if self.open != "message":
                    events += self._open_message()
                self.text += delta["content"]
                events.append(
                    self._event(
                        "response.output_text.delta",
                        item_id=self.output[-1]["id"],
                        output_index=self._index,
                        content_index=0,
                        delta=delta["content"],
                        logprobs=[],
                    )
                )
            for call in delta.get("tool_calls") or []:
                kind = f"call:{call['index']}"
                function = call.get("function") or {}
                if self.open != kind:
                    item = function_call_item(
                        call.get("id") or new_id("call"),
                        function.get("name") or "",
                        "",
                        new_id("fc"),
                    )
                    item["status"] = "in_progress"
                    events += self._add(kind, item)
                if function.get("arguments"):
                    self.output[-1]["arguments"] += function["arguments"]
                    events.append(
                        self._event(
                            "response.function_call_arguments.delta",
                            item_id=self.output[-1]["id"],
                            output_index=self._index,
                            delta=function["arguments"],
                        )
                    )
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
        return events
