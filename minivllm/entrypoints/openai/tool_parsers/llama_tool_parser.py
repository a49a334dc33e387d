"""`llama3_json`: Llama 3.x's JSON calls, `{"name": ..., "parameters": {...}}` (or
"arguments"), optionally after `<|python_tag|>`, several separated by `;`. An output that
does not start with `{` is content."""

from __future__ import annotations

from minivllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    CallReader,
    ToolParser,
    ToolParserManager,
)
from minivllm.entrypoints.openai.tool_parsers.json_call_scanner import JsonCallScanner

BOT = "<|python_tag|>"
_WS = " \t\r\n"


class Llama3JsonCallReader(CallReader):
    def __init__(self) -> None:
        super().__init__()
        self._buf = ""
        self._phase = "start"  # start, content, call, between, trailing (dropped)

    def _new_call(self) -> None:
        self.calls.append(JsonCallScanner("name", ("arguments", "parameters")))
        self._phase = "call"

    def feed(self, text: str) -> str:
        self._buf += text
        while self._buf:
            if self._phase == "start":
                rest = self._buf
                if rest.startswith(BOT):
                    rest = rest[len(BOT) :]
                elif BOT.startswith(rest):
                    return ""  # maybe the tag: wait
                rest = rest.lstrip(_WS)
                if not rest:
                    return ""  # only the tag and spaces so far: wait
                if rest[0] == "{":
                    self._buf = rest
                    self._new_call()
                else:
                    self._phase = "content"
            elif self._phase == "content":
                out, self._buf = self._buf, ""
                return out
            elif self._phase == "call":
                scanner = self.calls[-1]
                self._buf = self._buf[scanner.feed(self._buf) :]
                if not (scanner.done or scanner.error):
                    return ""
                self._phase = "trailing" if scanner.error else "between"
            elif self._phase == "between":
                rest = self._buf.lstrip(_WS + ";")
                self._buf = rest
                if rest:
                    if rest[0] == "{":
                        self._new_call()
                    else:
                        self._phase = "trailing"
            else:
                self._buf = ""
        return ""

    def finish(self) -> str:
        rest, self._buf = self._buf, ""
        return rest if self._phase == "start" else ""


@ToolParserManager.register_module("llama3_json")
class Llama3JsonToolParser(ToolParser):
    def make_reader(self) -> CallReader:
        return Llama3JsonCallReader()
