"""The reader both `<think>...</think>` parsers share: an optional `<think>` at the very
start, the reasoning up to `</think>`, the answer after it."""

from __future__ import annotations

from minivllm.reasoning.abs_reasoning_parsers import ReasoningParser


def partial_suffix_len(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `marker` (text
    held back: it may still become the marker). Tool parsers' readers use it too."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ThinkReader:
    """Phases: start (may be `<think>`), reasoning, content. Without `<think>` at the start
    the output is reasoning if `implicit_reasoning` (the prompt opened the block, or the
    model never writes the tag), else the answer."""

    def __init__(self, start: str, end: str, implicit_reasoning: bool) -> None:
        self.start, self.end = start, end
        self.implicit_reasoning = implicit_reasoning
        self._phase = "start"
        self._buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        self._buf += text
        if self._phase == "start":
            if self._buf.startswith(self.start):
                self._buf = self._buf[len(self.start) :]
                self._phase = "reasoning"
            elif self.start.startswith(self._buf):
                return "", ""  # may still be the start tag
            else:
                self._phase = "reasoning" if self.implicit_reasoning else "content"
        if self._phase == "reasoning":
            end = self._buf.find(self.end)
            if end < 0:
                keep = partial_suffix_len(self._buf, self.end)
                reasoning.append(self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep :]
            else:
                reasoning.append(self._buf[:end])
                self._buf = self._buf[end + len(self.end) :]
                self._phase = "content"
        if self._phase == "content":
            content.append(self._buf)
            self._buf = ""
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        rest, self._buf = self._buf, ""
        if self._phase == "content" or (self._phase == "start" and not self.implicit_reasoning):
            return "", rest
        return rest, ""


def prompt_opens_think(prompt: str | None, start: str, end: str) -> bool:
    """Whether the prompt's last `<think>` is still open (the template started the block)."""
    if not prompt:
        return False
    return prompt.rfind(start) > prompt.rfind(end)


class BaseThinkingReasoningParser(ReasoningParser):
    start_token = "<think>"
    end_token = "</think>"

    def implicit_reasoning(self, prompt: str | None) -> bool:
        raise NotImplementedError

    def starts_in_reasoning(self, prompt: str | None) -> bool:
        return self.implicit_reasoning(prompt)

    def reasoning_end_marker(self, prompt: str | None) -> str | None:
        # A prompt that ends with a closed block (thinking turned off by the template):
        # the answer starts at the first token.
        if prompt and prompt.rstrip().endswith(self.end_token):
            return None
        return self.end_token

    def make_reader(self, prompt: str | None) -> ThinkReader:
        return ThinkReader(self.start_token, self.end_token, self.implicit_reasoning(prompt))
