"""One tool call's JSON object read a character at a time: its name as soon as the name's
string closes, and the raw text of its arguments as far as it is known.

The arguments are the value's own text, byte for byte, so that streamed fragments and the
non-streamed call are the same string whatever the split; nothing is reserialized.
"""

from __future__ import annotations

import json

_WS = " \t\r\n"


class JsonCallScanner:
    """Reads `{"name": ..., "arguments": ...}` (keys as given) and stops at its closing brace.

    `error` is set on a character that cannot continue an object; `done` once it closed.
    The object's full validity is left to json.loads on `text` (see `is_valid`).
    """

    def __init__(self, name_key: str = "name", args_keys: tuple[str, ...] = ("arguments",)) -> None:
        self.name_key = name_key
        self.args_keys = args_keys
        self._chars: list[str] = []
        self.started = False
        self.done = False
        self.error = False
        self.name: str | None = None
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._expect = "key"  # at depth 1: key, colon, value, comma
        self._key: str | None = None
        self._token_start = 0  # where the depth-1 key or value being read starts
        self._value_kind: str | None = None  # string, container, literal
        self._args_start: int | None = None
        self._args_end: int | None = None
        self._args_kind: str | None = None

    @property
    def text(self) -> str:
        return "".join(self._chars)

    def feed(self, text: str) -> int:
        """Consume characters until the object closes or breaks; the number consumed."""
        for i, ch in enumerate(text):
            if self.done or self.error:
                return i
            self._feed_char(ch)
        return len(text)

    # ------------------------------------------------------------------ results

    @property
    def args_text(self) -> str:
        """The arguments' raw text known for certain so far (a bare literal such as 12 only
        once it ended); "{}" for a closed object without arguments."""
        if self._args_start is None:
            return "{}" if self.done else ""
        if self._args_end is not None:
            return "".join(self._chars[self._args_start : self._args_end])
        if self._args_kind == "literal":
            return ""
        return "".join(self._chars[self._args_start :])

    def is_valid(self) -> bool:
        """A closed object that parses as JSON, with a string name."""
        if not self.done or self.error or self.name is None:
            return False
        try:
            json.loads(self.text)
        except json.JSONDecodeError:
            return False
        return True

    # ------------------------------------------------------------------ the state machine

    def _feed_char(self, ch: str) -> None:
        if not self.started:
            if ch in _WS:
                return
            if ch != "{":
                self.error = True
                return
            self.started = True
            self._depth = 1
            self._chars.append(ch)
            return
        index = len(self._chars)
        self._chars.append(ch)
        if self._in_string:
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                self._in_string = False
                if self._depth == 1:
                    self._end_depth1_string(index)
            return
        if self._depth > 1:  # inside a nested value
            if ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 1:
                    self._end_value(index + 1)
            return
        if self._expect == "value" and self._value_kind == "literal":
            if ch in _WS or ch in ",}":
                self._end_value(index)
            else:
                return
        if ch in _WS:
            return
        if self._expect == "key":
            if ch == '"':
                self._in_string = True
                self._token_start = index
            elif ch == "}" and self._key is None:
                self._close()
            else:
                self.error = True
        elif self._expect == "colon":
            if ch == ":":
                self._expect = "value"
                self._value_kind = None
            else:
                self.error = True
        elif self._expect == "value":
            self._start_value(index, ch)
        elif self._expect == "comma":
            if ch == ",":
                self._expect = "key"
                self._key = None
            elif ch == "}":
                self._close()
            else:
                self.error = True

    def _start_value(self, index: int, ch: str) -> None:
        self._token_start = index
        if ch == '"':
            self._value_kind = "string"
            self._in_string = True
        elif ch in "{[":
            self._value_kind = "container"
            self._depth += 1
        elif ch in ",:}]":
            self.error = True
            return
        else:
            self._value_kind = "literal"
        if self._key in self.args_keys and self._args_start is None:
            self._args_start = index
            self._args_kind = self._value_kind

    def _end_depth1_string(self, index: int) -> None:
        if self._expect == "key":
            try:
                self._key = json.loads("".join(self._chars[self._token_start : index + 1]))
            except json.JSONDecodeError:
                self.error = True
                return
            self._expect = "colon"
        else:  # a string value
            self._end_value(index + 1)

    def _end_value(self, end: int) -> None:
        start = self._token_start
        if self._args_start == start and self._args_end is None:
            self._args_end = end
        if self._key == self.name_key and self.name is None and self._value_kind == "string":
            try:
                self.name = json.loads("".join(self._chars[start:end]))
            except json.JSONDecodeError:
                self.error = True
                return
        self._expect = "comma"
        self._value_kind = None

    def _close(self) -> None:
        self._depth = 0
        self.done = True
