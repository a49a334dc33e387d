"""Scripted streams for the parser tests: every way to split a text, and the streamed
deltas of a parser put back together (checking the OpenAI shape on the way)."""

from __future__ import annotations

import random
from collections.abc import Iterator

from minivllm.entrypoints.openai.tool_parsers import ToolParser


def splits(text: str, seed: int = 0) -> Iterator[list[str]]:
    """The text whole; cut once at every point; one character at a time; cut at every
    pair of points (short texts) or at random points; and with an empty last delta (the
    engine's finishing output often carries no text)."""
    yield [text]
    yield [text, ""]
    yield ["", *text, ""]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    if len(text) <= 80:
        for i in range(1, len(text)):
            for j in range(i + 1, len(text)):
                yield [text[:i], text[i:j], text[j:]]
    rng = random.Random(seed)
    for _ in range(200 if len(text) > 2 else 0):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        bounds = [0, *cuts, len(text)]
        yield [text[a:b] for a, b in zip(bounds, bounds[1:])] + [""]


def stream(parser: ToolParser, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """(content, [(name, arguments)]) from the streamed deltas, asserting the OpenAI shape:
    each call's first piece has its id, type and name (arguments ""), later ones only
    argument fragments; indices count up from 0."""
    content: list[str] = []
    calls: dict[int, list[str]] = {}
    previous = ""
    for k, piece in enumerate(pieces):
        current = previous + piece
        delta = parser.extract_tool_calls_streaming(
            previous, current, piece, finished=k == len(pieces) - 1
        )
        previous = current
        if delta is None:
            continue
        assert delta.content or delta.tool_calls, "an empty delta is returned as None"
        content.append(delta.content or "")
        for call in delta.tool_calls:
            if call.index not in calls:
                assert call.index == len(calls)
                assert call.id and call.type == "function"
                assert call.function.name and call.function.arguments == ""
                calls[call.index] = [call.function.name, ""]
            else:
                assert call.id is None and call.type is None and call.function.name is None
                assert call.function.arguments
                calls[call.index][1] += call.function.arguments
    return "".join(content), [(name, args) for name, args in calls.values()]


def whole(parser: ToolParser, text: str) -> tuple[str, list[tuple[str, str]]]:
    info = parser.extract_tool_calls(text)
    assert info.tools_called == bool(info.tool_calls)
    return info.content or "", [(c.function.name, c.function.arguments) for c in info.tool_calls]


def assert_streams_equal_whole(make_parser, text: str) -> tuple[str, list[tuple[str, str]]]:
    """Every split of `text` streams exactly the whole-text result; returns that result."""
    expected = whole(make_parser(), text)
    for pieces in splits(text):
        assert stream(make_parser(), pieces) == expected, pieces
    return expected
