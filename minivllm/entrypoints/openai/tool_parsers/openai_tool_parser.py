"""`openai` (vLLM's name): gpt-oss's tool calls, harmony messages to ``functions.{name}``
(``<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{...}``, the
turn ending with <|call|>), read from the rendered text (or from what the openai_gptoss
reasoning parser leaves as content: such messages whole). The arguments are the message's
text, as the model wrote it; the other messages' text is the content."""

from __future__ import annotations

import json

from minivllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    CallReader,
    ToolParser,
    ToolParserManager,
)
from minivllm.reasoning.gptoss_reasoning_parser import HarmonyMessages, recipient_of

_FUNCTIONS = "functions."


class HarmonyCall:
    def __init__(self, name: str) -> None:
        self.name: str | None = name
        self.args_text = ""

    def is_valid(self) -> bool:
        try:
            return isinstance(json.loads(self.args_text or "{}"), dict)
        except ValueError:
            return False


class HarmonyCallReader(CallReader):
    def __init__(self) -> None:
        super().__init__()
        self._messages = HarmonyMessages()
        self._call: HarmonyCall | None = None

    def feed(self, text: str) -> str:
        return self._route(self._messages.feed(text))

    def finish(self) -> str:
        return self._route(self._messages.finish())

    def _route(self, events: list[tuple[str, str]]) -> str:
        content: list[str] = []
        for kind, text in events:
            if kind == "start":
                recipient = recipient_of(text) or ""
                self._call = None
                if recipient.startswith(_FUNCTIONS):
                    self._call = HarmonyCall(recipient.removeprefix(_FUNCTIONS))
                    self.calls.append(self._call)
            elif kind == "end":
                self._call = None
            elif self._call is not None:
                self._call.args_text += text
            else:
                content.append(text)
        return "".join(content)


@ToolParserManager.register_module("openai")
class OpenAIToolParser(ToolParser):
    def make_reader(self) -> CallReader:
        return HarmonyCallReader()
