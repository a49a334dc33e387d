"""`openai_gptoss` (vLLM's name): gpt-oss's harmony replies. A reply is a series of
messages, each ``[<|start|>assistant]<|channel|>{channel}[ ...]<|message|>{text}<|end|>``
(the last ends the turn with <|return|> or <|call|>, which stop the generation and are not
in the text); the tokenizer renders the markers (tokenizer.py). The analysis channel's
text is the reasoning, the other channels' (final: the answer; commentary: a tool call's
preamble or arguments) the content. Text outside any message, from a reply that does not
follow the format, is content."""

from __future__ import annotations

from minivllm.reasoning.abs_reasoning_parsers import ReasoningParser, ReasoningParserManager
from minivllm.reasoning.basic_parsers import partial_suffix_len

_START, _CHANNEL, _MESSAGE, _END = "<|start|>", "<|channel|>", "<|message|>", "<|end|>"
_FINAL = f"{_CHANNEL}final{_MESSAGE}"


class HarmonyReader:
    """Phases: header (up to <|message|>) and body (up to <|end|>); held back: what may
    still become a marker."""

    def __init__(self) -> None:
        self._phase = "header"
        self._reasoning = False  # the current body's channel is analysis
        self._buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        self._buf += text
        while self._buf:
            if self._phase == "header":
                if not self._may_be_header(self._buf):  # not the format: content
                    self._phase, self._reasoning = "body", False
                    continue
                at = self._buf.find(_MESSAGE)
                if at < 0:
                    break  # the header is not complete yet
                header = self._buf[:at]
                channel = header.split(_CHANNEL, 1)[1] if _CHANNEL in header else ""
                self._reasoning = channel.split()[0:1] == ["analysis"]
                self._buf = self._buf[at + len(_MESSAGE) :]
                self._phase = "body"
                continue
            end = self._buf.find(_END)
            cut = end if end >= 0 else len(self._buf) - partial_suffix_len(self._buf, _END)
            (reasoning if self._reasoning else content).append(self._buf[:cut])
            if end < 0:
                self._buf = self._buf[cut:]
                break
            self._buf = self._buf[end + len(_END) :]
            self._phase = "header"
        return "".join(reasoning), "".join(content)

    @staticmethod
    def _may_be_header(text: str) -> bool:
        """Whether text is, or may still become, a message header."""
        return any(text.startswith(m) or m.startswith(text) for m in (_START, _CHANNEL))

    def finish(self) -> tuple[str, str]:
        rest, self._buf = self._buf, ""
        if self._phase == "header":
            # A header the reply never completed has no text of its own; text that only
            # began like a marker is content.
            return ("", "") if rest.startswith((_START, _CHANNEL)) else ("", rest)
        return (rest, "") if self._reasoning else ("", rest)


@ReasoningParserManager.register_module("openai_gptoss")
class GptOssReasoningParser(ReasoningParser):
    def make_reader(self, prompt: str | None) -> HarmonyReader:
        return HarmonyReader()

    def starts_in_reasoning(self, prompt: str | None) -> bool:
        return False

    def reasoning_end_marker(self, prompt: str | None) -> str | None:
        # A structured output constrains the final channel's message.
        return _FINAL
