"""The waiting queue, in first-come-first-served or priority order."""

from __future__ import annotations

import heapq
from collections import deque

from minivllm.core.request import Request


class FCFSRequestQueue(deque):
    """Arrival order; a preempted request goes back to the front."""

    def add_request(self, request: Request) -> None:
        self.append(request)

    def prepend_request(self, request: Request) -> None:
        self.appendleft(request)

    def peek_request(self) -> Request:
        return self[0]

    def pop_request(self) -> Request:
        return self.popleft()

    def remove_requests(self, requests: set[Request]) -> None:
        kept = [r for r in self if r not in requests]
        self.clear()
        self.extend(kept)


class PriorityRequestQueue:
    """Lowest (priority, arrival time) first; a preempted request keeps its place by key."""

    def __init__(self) -> None:
        self._heap: list[Request] = []

    def add_request(self, request: Request) -> None:
        heapq.heappush(self._heap, request)

    prepend_request = add_request

    def peek_request(self) -> Request:
        return self._heap[0]

    def pop_request(self) -> Request:
        return heapq.heappop(self._heap)

    def remove_requests(self, requests: set[Request]) -> None:
        self._heap = [r for r in self._heap if r not in requests]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self):
        return iter(sorted(self._heap))


def create_request_queue(policy: str) -> FCFSRequestQueue | PriorityRequestQueue:
    if policy == "fcfs":
        return FCFSRequestQueue()
    if policy == "priority":
        return PriorityRequestQueue()
    raise ValueError(f"Unknown scheduling policy {policy!r}: expected 'fcfs' or 'priority'.")
