"""`hermes`: calls as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes 2
Pro, Qwen2.5 and Qwen3); the content is the text before the first call."""

from __future__ import annotations

from minivllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    CallReader,
    MarkedCallReader,
    ToolParser,
    ToolParserManager,
)
from minivllm.entrypoints.openai.tool_parsers.json_call_scanner import JsonCallScanner

START, END = "<tool_call>", "</tool_call>"


class HermesCallReader(MarkedCallReader):
    start_marker = START

    def new_call(self) -> JsonCallScanner:
        return JsonCallScanner("name", ("arguments",))

    def read_call(self, text: str) -> tuple[int, bool]:
        # The JSON object's end ends the call; the rest of the block, up to </tool_call>,
        # is dropped with the text between calls.
        scanner = self.calls[-1]
        used = scanner.feed(text)
        return used, scanner.done or scanner.error


@ToolParserManager.register_module("hermes")
class Hermes2ProToolParser(ToolParser):
    tool_call_start_token = START
    tool_call_end_token = END

    def make_reader(self) -> CallReader:
        return HermesCallReader()

    def adjust_request(self, request):
        """Keep special tokens in the text when the markers are special tokens (vLLM's)."""
        special = getattr(self.model_tokenizer, "all_special_tokens", None) or ()
        if request.tools_enabled and START in special:
            request.skip_special_tokens = False
        return request
