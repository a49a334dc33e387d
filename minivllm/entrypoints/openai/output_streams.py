"""Helpers over the engine's delta streams: several merged into one, one choice's deltas
accumulated for a non-streaming response, and the usage they add up to."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from minivllm.entrypoints.openai.protocol import UsageInfo


class SequenceText:
    """One choice's deltas, accumulated for a non-streaming response."""

    def __init__(self, prefix: str = "") -> None:
        self.parts = [prefix] if prefix else []
        self.token_ids: list[int] = []
        self.logprobs: list[dict] | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    def add(self, completion) -> None:
        self.parts.append(completion.text)
        self.token_ids.extend(completion.token_ids)
        if completion.logprobs is not None:
            self.logprobs = (self.logprobs or []) + list(completion.logprobs)
        if completion.finish_reason is not None:
            self.finish_reason = completion.finish_reason
            self.stop_reason = completion.stop_reason

    def drop_generated(self, prefix: str) -> None:
        """Keep the echoed prompt only (echo with max_tokens 0): what the engine sampled to
        score the prompt is no part of the answer."""
        self.parts = [prefix] if prefix else []
        self.token_ids = []
        self.logprobs = [] if self.logprobs is not None else None

    @property
    def text(self) -> str:
        return "".join(self.parts)


def has_news(completion) -> bool:
    """Whether a delta is worth a stream chunk: new text, new tokens, or the end."""
    return bool(completion.text or completion.token_ids or completion.finish_reason)


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=num_completion_tokens,
        total_tokens=num_prompt_tokens + num_completion_tokens,
    )


async def merge_async_iterators(
    *iterators: AsyncIterator,
) -> AsyncIterator[tuple[int, Any]]:
    """Items of several async iterators as they come, each with its iterator's index.

    When the consumer stops early or one iterator fails, the others are cancelled and
    closed (which aborts their requests).
    """
    if len(iterators) == 1:
        async with contextlib.aclosing(iterators[0]) as only:
            async for item in only:
                yield 0, item
        return
    pending: dict[asyncio.Task, int] = {
        asyncio.ensure_future(it.__anext__()): i for i, it in enumerate(iterators)
    }
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                index = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(iterators[index].__anext__())] = index
                yield index, item
    finally:
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        for it in iterators:
            with contextlib.suppress(Exception):
                await it.aclose()
