"""ReasoningParser (vLLM's interface) and its registry, ReasoningParserManager.

A parser is made per request and reads one output: the whole of it
(extract_reasoning_content) or delta by delta (extract_reasoning_content_streaming); both
run the same reader, so the streamed pieces of any split concatenate to the whole result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass
class ReasoningDelta:
    """What one delta adds: to the reasoning, to the answer (None: nothing)."""

    reasoning_content: str | None = None
    content: str | None = None


class ReasoningParser:
    """vLLM's ReasoningParser. `finished=True` on the last delta (minivllm's) releases text
    held back because it could have begun a marker."""

    def __init__(self, tokenizer: Any = None) -> None:
        self.model_tokenizer = tokenizer
        self._reader = None

    def make_reader(self, prompt: str | None):
        raise NotImplementedError

    def starts_in_reasoning(self, prompt: str | None) -> bool:
        """Whether the output begins inside the reasoning (the prompt opened it)."""
        raise NotImplementedError

    def reasoning_end_marker(self, prompt: str | None) -> str | None:
        """The text after which the answer starts (structured outputs constrain only what
        follows it), or None when the output may be the answer from its first token."""
        raise NotImplementedError

    def extract_reasoning_content(
        self, model_output: str, request=None, prompt: str | None = None
    ) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; None for an empty part."""
        reader = self.make_reader(prompt)
        reasoning, content = reader.feed(model_output)
        more_reasoning, more_content = reader.finish()
        return (reasoning + more_reasoning) or None, (content + more_content) or None

    def extract_reasoning_content_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int] = (),
        current_token_ids: Sequence[int] = (),
        delta_token_ids: Sequence[int] = (),
        *,
        prompt: str | None = None,
        finished: bool = False,
    ) -> ReasoningDelta | None:
        """The reasoning and content that `delta_text` adds (deltas in order, each once)."""
        if self._reader is None:
            self._reader = self.make_reader(prompt)
        reasoning, content = self._reader.feed(delta_text)
        if finished:
            more_reasoning, more_content = self._reader.finish()
            reasoning += more_reasoning
            content += more_content
        if not reasoning and not content:
            return None
        return ReasoningDelta(reasoning or None, content or None)


class ReasoningParserManager:
    """The reasoning parsers by name (`--reasoning-parser NAME`)."""

    reasoning_parsers: dict[str, type[ReasoningParser]] = {}

    @classmethod
    def register_module(cls, name: str) -> Callable[[type[ReasoningParser]], type[ReasoningParser]]:
        def register(parser: type[ReasoningParser]) -> type[ReasoningParser]:
            cls.reasoning_parsers[name] = parser
            return parser

        return register

    @classmethod
    def get_reasoning_parser(cls, name: str) -> type[ReasoningParser]:
        if name not in cls.reasoning_parsers:
            raise KeyError(f"reasoning helper: '{name}' not found in reasoning_parser")
        return cls.reasoning_parsers[name]

    @classmethod
    def names(cls) -> list[str]:
        return sorted(cls.reasoning_parsers)
