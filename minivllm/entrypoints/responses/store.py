"""Stored responses (`store: true`), kept in memory within a bound of count and bytes: the
oldest go first, and an id that is gone answers 404, as vLLM's store does."""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any


class ResponseStore:
    """Each stored response with the conversation that led to it (the chat messages of its
    input and output), so that `previous_response_id` continues it."""

    def __init__(self, max_count: int = 1000, max_bytes: int = 64 << 20) -> None:
        self.max_count = max_count
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, tuple[dict, list[dict], int]] = OrderedDict()
        self._bytes = 0

    def put(self, response: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        size = len(json.dumps(response)) + len(json.dumps(messages))
        if size > self.max_bytes:
            return  # larger than the whole store: not kept
        self.pop(response["id"])
        self._entries[response["id"]] = (response, messages, size)
        self._bytes += size
        while len(self._entries) > self.max_count or self._bytes > self.max_bytes:
            _, (_, _, dropped) = self._entries.popitem(last=False)
            self._bytes -= dropped

    def get(self, response_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
        entry = self._entries.get(response_id)
        return None if entry is None else (entry[0], entry[1])

    def pop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self._bytes -= entry[2]

    def __len__(self) -> int:
        return len(self._entries)
