"""`gemma4` (vLLM's name): Gemma 4's calls, `<|tool_call>call:NAME{ARGS}<tool_call|>`, one
after another with nothing between. ARGS is Gemma's own notation, not JSON: keys bare,
strings between `<|"|>` marks, numbers, true/false/null, {objects} and [lists]; it becomes
the call's JSON arguments once the call is closed. The content is the text before the
first call (the text between or after calls is dropped, as hermes does); the markers are
in the text (tokenizer.render_message_markers)."""

from __future__ import annotations

import json
from typing import Any

from minivllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    CallReader,
    MarkedCallReader,
    ToolParser,
    ToolParserManager,
)

START, END = "<|tool_call>", "<tool_call|>"
QUOTE = '<|"|>'
_CALL = "call:"


class Gemma4Call:
    def __init__(self) -> None:
        self.name: str | None = None
        self.args_text = ""
        self.valid = False

    def is_valid(self) -> bool:
        return self.valid

    def close(self, block: str) -> None:
        """The call's whole text (between the markers): its name and JSON arguments, or,
        where it does not parse, the text as it is (the call is then not valid)."""
        block = block.strip()
        head = block.split("{", 1)[0]
        self.name = self.name or _name_of(head) or head
        self.args_text = block
        try:
            value, end = parse_value(block, len(head))
        except ValueError:
            return
        if _name_of(head) and isinstance(value, dict) and not block[end:].strip():
            self.args_text = json.dumps(value, ensure_ascii=False)
            self.valid = True


def _name_of(head: str) -> str | None:
    """The function's name in a call's text before its arguments (``call:NAME``)."""
    head = head.strip()
    return head.removeprefix(_CALL).strip() or None if head.startswith(_CALL) else None


class Gemma4CallReader(MarkedCallReader):
    start_marker = START

    def new_call(self) -> Gemma4Call:
        return Gemma4Call()

    def read_call(self, text: str) -> tuple[int, bool]:
        # The call's text is read whole once its end marker is there.
        call = self.calls[-1]
        if call.name is None and "{" in text:  # the name, before the arguments
            call.name = _name_of(text.split("{", 1)[0])
        end = text.find(END)
        if end < 0:
            return 0, False
        call.close(text[:end])
        return end + len(END), True

    def finish_call(self, text: str) -> None:
        self.calls[-1].close(text)  # never closed: what it has (as far as it parses)


def parse_value(text: str, at: int) -> tuple[Any, int]:
    """The value of Gemma's notation at text[at:] and the index after it (ValueError)."""
    at = _skip_spaces(text, at)
    if text.startswith(QUOTE, at):
        end = text.find(QUOTE, at + len(QUOTE))
        if end < 0:
            raise ValueError("unclosed string")
        return text[at + len(QUOTE) : end], end + len(QUOTE)
    if text.startswith("{", at):
        return _parse_items(text, at + 1, "}", keyed=True)
    if text.startswith("[", at):
        return _parse_items(text, at + 1, "]", keyed=False)
    end = at
    while end < len(text) and text[end] not in ",}]":
        end += 1
    word = text[at:end].strip()
    if not word or ":" in word:  # (a colon: a key whose comma is missing)
        raise ValueError(f"no value at {at}")
    try:
        return json.loads(word), end  # numbers, true, false, null
    except ValueError:
        return word, end  # a bare word: as the model wrote it


def _parse_items(text: str, at: int, close: str, keyed: bool) -> tuple[Any, int]:
    items: dict[str, Any] | list[Any] = {} if keyed else []
    at = _skip_spaces(text, at)
    if text.startswith(close, at):
        return items, at + 1
    while True:
        if keyed:
            colon = text.find(":", at)
            if colon < 0:
                raise ValueError("a key without a value")
            key = text[at:colon].strip()
            if key.startswith(QUOTE) and key.endswith(QUOTE) and len(key) >= 2 * len(QUOTE):
                key = key[len(QUOTE) : -len(QUOTE)]
            value, at = parse_value(text, colon + 1)
            items[key] = value
        else:
            value, at = parse_value(text, at)
            items.append(value)
        at = _skip_spaces(text, at)
        if text.startswith(close, at):
            return items, at + 1
        if not text.startswith(",", at):
            raise ValueError(f"expected ',' or {close!r} at {at}")
        at = _skip_spaces(text, at + 1)


def _skip_spaces(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


@ToolParserManager.register_module("gemma4")
class Gemma4ToolParser(ToolParser):
    tool_call_start_token = START
    tool_call_end_token = END

    def make_reader(self) -> CallReader:
        return Gemma4CallReader()
