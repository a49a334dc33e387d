"""ToolParser (vLLM's interface) and its registry, ToolParserManager.

A parser is made per request. Both of its paths run one reader over the text, so the
deltas streamed for a text, however it is split, concatenate to exactly the call list and
content of the whole text: the streamed path feeds each delta and sends what the reader
newly knows; the whole path feeds everything at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from minivllm.entrypoints.openai.protocol import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCallInformation,
    FunctionCall,
    ToolCall,
    make_tool_call_id,
)
from minivllm.reasoning.basic_parsers import partial_suffix_len


class CallState(Protocol):
    """One call as a reader sees it: name once known, the arguments' text known so far."""

    name: str | None
    args_text: str

    def is_valid(self) -> bool: ...


class CallReader:
    """Reads one output, delta by delta: returns the content text it is sure of, collects
    calls in `calls`. Text that may still start a marker is held back until finish()."""

    def __init__(self) -> None:
        self.calls: list[CallState] = []

    def feed(self, text: str) -> str:
        raise NotImplementedError

    def finish(self) -> str:
        return ""


class MarkedCallReader(CallReader):
    """Calls that each begin with a start marker (hermes's `<tool_call>`, Gemma 4's
    `<|tool_call>`): the content is the text before the first; a subclass reads each call
    (``new_call``, ``read_call``); text between or after calls is dropped, as vLLM does."""

    start_marker = ""

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""
        self._phase = "content"  # content, call, between (after a call; text is dropped)

    def new_call(self) -> CallState:
        raise NotImplementedError

    def read_call(self, text: str) -> tuple[int, bool]:
        """Reads the current call (self.calls[-1]) from text, the unread part of the output:
        how much of it the call took (the rest is read again with more), and whether the
        call is over."""
        raise NotImplementedError

    def finish_call(self, text: str) -> None:
        """The output ended inside the call, with text unread."""

    def feed(self, text: str) -> str:
        out: list[str] = []
        self._buf += text
        while True:
            if self._phase == "call":
                used, over = self.read_call(self._buf)
                self._buf = self._buf[used:]
                if not over:
                    break
                self._phase = "between"
                continue
            start = self._buf.find(self.start_marker)
            if start < 0:
                keep = partial_suffix_len(self._buf, self.start_marker)
                if self._phase == "content":
                    out.append(self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep :]
                break
            if self._phase == "content":
                out.append(self._buf[:start])
            self._buf = self._buf[start + len(self.start_marker) :]
            self.calls.append(self.new_call())
            self._phase = "call"
        return "".join(out)

    def finish(self) -> str:
        rest, self._buf = self._buf, ""
        if self._phase == "call":
            self.finish_call(rest)
        return rest if self._phase == "content" else ""


class ToolParser:
    """vLLM's ToolParser: extract_tool_calls() for a whole output, and
    extract_tool_calls_streaming() for each delta (minivllm's `finished=True` on the last
    one releases text held back because it could have begun a marker)."""

    def __init__(self, tokenizer: Any = None) -> None:
        self.model_tokenizer = tokenizer
        self._reader: CallReader | None = None
        self._sent: list[tuple[int | None, int]] = []  # per call: stream index, args sent
        self._num_streamed = 0

    def make_reader(self) -> CallReader:
        raise NotImplementedError

    def adjust_request(self, request):
        """vLLM's hook: the request as this parser needs it (e.g. special tokens kept)."""
        return request

    # ------------------------------------------------------------------ whole output

    def extract_tool_calls(self, model_output: str, request=None) -> ExtractedToolCallInformation:
        reader = self.make_reader()
        content = reader.feed(model_output) + reader.finish()
        if not reader.calls:
            return ExtractedToolCallInformation(tools_called=False, content=content or None)
        if not all(call.is_valid() for call in reader.calls):
            # As vLLM: a call that does not parse leaves the whole output as content.
            return ExtractedToolCallInformation(tools_called=False, content=model_output)
        calls = [
            ToolCall(function=FunctionCall(name=call.name, arguments=call.args_text))
            for call in reader.calls
        ]
        return ExtractedToolCallInformation(
            tools_called=True, tool_calls=calls, content=content or None
        )

    # ------------------------------------------------------------------ streamed output

    def extract_tool_calls_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int] = (),
        current_token_ids: Sequence[int] = (),
        delta_token_ids: Sequence[int] = (),
        request=None,
        *,
        finished: bool = False,
    ) -> DeltaMessage | None:
        """The delta for `delta_text` (the deltas must come in order, each once)."""
        if self._reader is None:
            self._reader = self.make_reader()
        reader = self._reader
        content = reader.feed(delta_text)
        if finished:
            content += reader.finish()
        tool_calls = self._new_call_deltas(reader)
        if not content and not tool_calls:
            return None
        return DeltaMessage(content=content or None, tool_calls=tool_calls)

    def _new_call_deltas(self, reader: CallReader) -> list[DeltaToolCall]:
        deltas: list[DeltaToolCall] = []
        while len(self._sent) < len(reader.calls):
            self._sent.append((None, 0))
        for i, call in enumerate(reader.calls):
            index, sent = self._sent[i]
            if index is None:
                if call.name is None:
                    continue
                index = self._num_streamed
                self._num_streamed += 1
                deltas.append(
                    DeltaToolCall(
                        index=index,
                        id=make_tool_call_id(),
                        type="function",
                        function=DeltaFunctionCall(name=call.name, arguments=""),
                    )
                )
            args = call.args_text
            if len(args) > sent:
                deltas.append(
                    DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=args[sent:]))
                )
                sent = len(args)
            self._sent[i] = (index, sent)
        return deltas


class ToolParserManager:
    """The tool parsers by name (`--tool-call-parser NAME`)."""

    tool_parsers: dict[str, type[ToolParser]] = {}

    @classmethod
    def register_module(cls, name: str) -> Callable[[type[ToolParser]], type[ToolParser]]:
        def register(parser: type[ToolParser]) -> type[ToolParser]:
            cls.tool_parsers[name] = parser
            return parser

        return register

    @classmethod
    def get_tool_parser(cls, name: str) -> type[ToolParser]:
        if name not in cls.tool_parsers:
            raise KeyError(f"tool helper parser '{name}' not found in tool parsers")
        return cls.tool_parsers[name]

    @classmethod
    def names(cls) -> list[str]:
        return sorted(cls.tool_parsers)
