"""One chat choice's output split into reasoning, content and tool calls: the whole text
(parse) or delta by delta (feed), with the same readers so the two always agree."""

from __future__ import annotations

from minivllm.entrypoints.openai.protocol import DeltaMessage, DeltaToolCall, ToolCall
from minivllm.entrypoints.openai.tool_parsers import ToolParser
from minivllm.reasoning import ReasoningParser


class ChoiceOutput:
    def __init__(
        self,
        reasoning_parser: ReasoningParser | None,
        tool_parser: ToolParser | None,
        prompt: str | None,
        parallel_tool_calls: bool = True,
    ) -> None:
        self.reasoning_parser = reasoning_parser
        self.tool_parser = tool_parser
        self.prompt = prompt
        self.parallel_tool_calls = parallel_tool_calls
        self.tools_called = False
        self._text = ""  # the answer's text fed to the tool parser so far

    # ------------------------------------------------------------------ whole output

    def parse(self, text: str) -> tuple[str | None, str | None, list[ToolCall]]:
        """(reasoning_content, content, tool_calls) of a whole output."""
        reasoning, content = None, text
        if self.reasoning_parser is not None:
            reasoning, content = self.reasoning_parser.extract_reasoning_content(
                text, prompt=self.prompt
            )
        if self.tool_parser is None:
            return reasoning, content, []
        info = self.tool_parser.extract_tool_calls(content or "")
        calls = info.tool_calls if self.parallel_tool_calls else info.tool_calls[:1]
        self.tools_called = bool(calls)
        return reasoning, info.content, calls

    # ------------------------------------------------------------------ streamed output

    def feed(self, delta_text: str, token_ids=(), finished: bool = False) -> DeltaMessage | None:
        """What `delta_text` adds (None: nothing yet); `finished` on the last delta."""
        reasoning, content = None, delta_text
        if self.reasoning_parser is not None:
            delta = self.reasoning_parser.extract_reasoning_content_streaming(
                "", "", delta_text, (), (), token_ids, prompt=self.prompt, finished=finished
            )
            reasoning, content = (delta.reasoning_content, delta.content) if delta else (None, None)
        tool_calls: list[DeltaToolCall] = []
        if self.tool_parser is not None and (content or finished):
            previous = self._text
            self._text += content or ""
            delta = self.tool_parser.extract_tool_calls_streaming(
                previous, self._text, content or "", finished=finished
            )
            content = delta.content if delta else None
            tool_calls = delta.tool_calls if delta else []
            if not self.parallel_tool_calls:
                tool_calls = [call for call in tool_calls if call.index == 0]
            self.tools_called = self.tools_called or bool(tool_calls)
        if not reasoning and not content and not tool_calls:
            return None
        return DeltaMessage(reasoning_content=reasoning, content=content, tool_calls=tool_calls)


def split_tool_calls(delta: DeltaMessage) -> list[DeltaMessage]:
    """One stream chunk per tool call piece: a call's header (id, type, name) never shares
    a chunk with its first argument fragment, as OpenAI streams them."""
    if len(delta.tool_calls) <= 1:
        return [delta]
    first = DeltaMessage(
        reasoning_content=delta.reasoning_content,
        content=delta.content,
        tool_calls=delta.tool_calls[:1],
    )
    return [first] + [DeltaMessage(tool_calls=[call]) for call in delta.tool_calls[1:]]
