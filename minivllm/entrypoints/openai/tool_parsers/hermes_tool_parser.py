"""`hermes`: calls as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes 2
Pro, Qwen2.5 and Qwen3); the content is the text before the first call."""

from __future__ import annotations

from minivllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    CallReader,
    ToolParser,
    ToolParserManager,
)
from minivllm.entrypoints.openai.tool_parsers.json_call_scanner import JsonCallScanner
from minivllm.reasoning.basic_parsers import partial_suffix_len

START, END = "<tool_call>", "</tool_call>"


class HermesCallReader(CallReader):
    def __init__(self) -> None:
        super().__init__()
        self._buf = ""
        self._phase = "content"  # content, call, between (after a call; text is dropped)

    def feed(self, text: str) -> str:
        out: list[str] = []
        self._buf += text
        while True:
            if self._phase == "call":
                scanner = self.calls[-1]
                used = scanner.feed(self._buf)
                self._buf = self._buf[used:]
                if not (scanner.done or scanner.error):
                    break
                self._phase = "between"  # the rest of the block, up to </tool_call>, is dropped
                continue
            start = self._buf.find(START)
            if start < 0:
                keep = partial_suffix_len(self._buf, START)
                if self._phase == "content":
                    out.append(self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep :]
                break
            if self._phase == "content":
                out.append(self._buf[:start])
            self._buf = self._buf[start + len(START) :]
            self.calls.append(JsonCallScanner("name", ("arguments",)))
            self._phase = "call"
        return "".join(out)

    def finish(self) -> str:
        rest, self._buf = self._buf, ""
        return rest if self._phase == "content" else ""


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
