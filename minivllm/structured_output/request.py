"""One request's structured-output state: its compiling grammar, then its matcher."""

from __future__ import annotations

import time
from concurrent.futures import Future

from minivllm.sampling_params import StructuredOutputsParams


class StructuredOutputRequest:
    def __init__(
        self, params: StructuredOutputsParams, compiled: Future, timeout: float | None = None
    ) -> None:
        self.params = params
        self.compiled = compiled  # a Future of the CompiledGrammar
        # When waiting for it stops: the request fails, the compile goes on for the cache.
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.timeout = timeout
        self.matcher = None  # made once the grammar is ready
        self.error: str | None = None  # why compiling or starting the matcher failed
        # Set when filling this request's bitmask row failed: the scheduler then fails it.
        self.failure: Exception | None = None
        # Without a reasoning end marker the constraint applies from the first token.
        self.reasoning_ended = params.reasoning_end is None
        self.reasoning_end_ids: list[int] = []

    def is_ready(self, make_matcher) -> bool:
        """True once the matcher exists; False while compiling, or once it failed (error)."""
        if self.matcher is not None:
            return True
        if self.error is not None:
            return False
        if not self.compiled.done():
            if self.deadline is not None and time.monotonic() > self.deadline:
                self.error = f"The grammar took more than {self.timeout:g} s to compile."
            return False
        try:
            self.matcher = make_matcher(self.compiled.result())  # result() raises its error
        except Exception as exc:
            self.error = str(exc)
            return False
        return True

    @property
    def failed(self) -> bool:
        return self.error is not None

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
