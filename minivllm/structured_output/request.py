"""One request's structured-output state: its compiling grammar, then its matcher."""

from __future__ import annotations

from concurrent.futures import Future

from minivllm.sampling_params import StructuredOutputsParams


class StructuredOutputRequest:
    def __init__(self, params: StructuredOutputsParams, compiled: Future) -> None:
        self.params = params
        self.compiled = compiled  # a Future of the CompiledGrammar
        self.matcher = None  # made once the grammar is ready
        self.error: str | None = None
        # Without a reasoning end marker the constraint applies from the first token.
        self.reasoning_ended = params.reasoning_end is None
        self.reasoning_end_ids: list[int] = []

    def is_ready(self, make_matcher) -> bool:
        """True once the matcher exists; False while compiling or when compiling failed."""
        if self.matcher is not None:
            return True
        if not self.compiled.done():
            return False
        exc = self.compiled.exception()
        if exc is not None:
            self.error = str(exc)
            return False
        self.matcher = make_matcher(self.compiled.result())
        return True

    @property
    def failed(self) -> bool:
        return self.compiled.done() and self.compiled.exception() is not None

    def see_output(self, output_ids: list[int]) -> None:
        """Note the reasoning's end once the output ends with its marker's tokens."""
        ids = self.reasoning_end_ids
        if not self.reasoning_ended and ids and output_ids[-len(ids) :] == ids:
            self.reasoning_ended = True

    def accept(self, token_id: int) -> bool:
        """Advance the matcher by one sampled token (no-op before the reasoning ends or
        after the grammar is complete, where only stop tokens were allowed)."""
        if not self.reasoning_ended or self.matcher.is_terminated():
            return True
        return self.matcher.accept_token(token_id)
