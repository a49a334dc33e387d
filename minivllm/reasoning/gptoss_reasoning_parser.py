"""`openai_gptoss` (vLLM's name): gpt-oss's harmony replies. A reply is a series of
messages, each ``[<|start|>assistant]<|channel|>{channel}[ to={recipient}][ ...]<|message|>
{text}<|end|>`` (the last ends the turn with <|return|> or <|call|>, which stop the
generation and are not in the text); the tokenizer renders the markers (tokenizer.py).
The analysis channel's text is the reasoning, the other channels' (final: the answer;
commentary: a preamble) the content. A message to a recipient (a tool call) stays whole in
the content, markers included, for the `openai` tool parser. Text outside any message, from
a reply that does not follow the format, is content."""

from __future__ import annotations

import re

from minivllm.reasoning.abs_reasoning_parsers import ReasoningParser, ReasoningParserManager
from minivllm.reasoning.basic_parsers import partial_suffix_len

START, CHANNEL, MESSAGE, END = "<|start|>", "<|channel|>", "<|message|>", "<|end|>"
_FINAL = f"{CHANNEL}final{MESSAGE}"
_RECIPIENT = re.compile(r"to=(\S+?)(?=\s|<\||$)")


def channel_of(header: str) -> str:
    """The channel a message header names ("" for none)."""
    rest = header.split(CHANNEL, 1)[1] if CHANNEL in header else ""
    return (rest.split() or [""])[0].split("<|")[0]


def recipient_of(header: str) -> str | None:
    """Whom a message is addressed to (``functions.get_weather``), or None."""
    match = _RECIPIENT.search(header)
    return match.group(1) if match else None


class HarmonyMessages:
    """Rendered harmony text, delta by delta, as events: ("start", header) once a message's
    header is complete, ("text", text) for its body (or for text outside any message, before
    any "start"), ("end", "") at its <|end|>. Text that may still become a marker is held
    back until finish()."""

    def __init__(self) -> None:
        self._phase = "header"
        self._buf = ""

    def feed(self, text: str) -> list[tuple[str, str]]:
        events: list[tuple[str, str]] = []
        self._buf += text
        while self._buf:
            if self._phase == "header":
                if not _may_be_header(self._buf):
                    self._phase = "body"  # not the format: text outside any message
                    continue
                at = self._buf.find(MESSAGE)
                if at < 0:
                    break  # the header is not complete yet
                events.append(("start", self._buf[:at]))
                self._buf = self._buf[at + len(MESSAGE) :]
                self._phase = "body"
                continue
            end = self._buf.find(END)
            cut = end if end >= 0 else len(self._buf) - partial_suffix_len(self._buf, END)
            if cut:
                events.append(("text", self._buf[:cut]))
            if end < 0:
                self._buf = self._buf[cut:]
                break
            self._buf = self._buf[end + len(END) :]
            events.append(("end", ""))
            self._phase = "header"
        return events

    def finish(self) -> list[tuple[str, str]]:
        rest, self._buf = self._buf, ""
        if not rest or (self._phase == "header" and rest.startswith((START, CHANNEL))):
            return []  # a header the reply never completed has no text of its own
        return [("text", rest)]


def _may_be_header(text: str) -> bool:
    """Whether text is, or may still become, a message header."""
    return any(text.startswith(m) or m.startswith(text) for m in (START, CHANNEL))


class HarmonyReader:
    """(reasoning, content) of the events: analysis to the reasoning, a message to a
    recipient whole to the content, the other messages' text to the content."""

    def __init__(self) -> None:
        self._messages = HarmonyMessages()
        self._where = "content"

    def feed(self, text: str) -> tuple[str, str]:
        return self._route(self._messages.feed(text))

    def finish(self) -> tuple[str, str]:
        return self._route(self._messages.finish())

    def _route(self, events: list[tuple[str, str]]) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        for kind, text in events:
            if kind == "start":
                if channel_of(text) == "analysis":
                    self._where = "reasoning"
                elif recipient_of(text) is not None:
                    self._where = "call"
                    content.append(text + MESSAGE)
                else:
                    self._where = "content"
            elif kind == "end":
                if self._where == "call":
                    content.append(END)
                self._where = "content"
            else:
                (reasoning if self._where == "reasoning" else content).append(text)
        return "".join(reasoning), "".join(content)


@ReasoningParserManager.register_module("openai_gptoss")
class GptOssReasoningParser(ReasoningParser):
    def make_reader(self, prompt: str | None) -> HarmonyReader:
        return HarmonyReader()

    def starts_in_reasoning(self, prompt: str | None) -> bool:
        return False

    def reasoning_end_marker(self, prompt: str | None) -> str | None:
        # A structured output constrains the final channel's message.
        return _FINAL
