"""Incremental detokenization and stop strings, in the frontend."""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from minivllm.engine.stop_strings import StopStringMatcher
from minivllm.sampling_params import SamplingParams

# The start of the error DecodeStream.step raises when new text does not extend the old.
_INVALID_PREFIX = "Invalid prefix encountered"


class IncrementalDetokenizer:
    """Turns a request's tokens into text as they arrive.

    The tokenizers library's DecodeStream holds back bytes that do not yet form a whole
    UTF-8 character, so the text never contains a broken character; the prompt primes it,
    so a token's leading space is rendered as it would be in context.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._tokenizer = tokenizer._tokenizer  # the Rust tokenizer behind the HF wrapper
        self._stream = DecodeStream(
            ids=list(prompt_token_ids), skip_special_tokens=params.skip_special_tokens
        )
        self.params = params
        self.output_text = ""
        self.num_unread = 0  # of the last update's tokens, those after its stop string
        self._stops = StopStringMatcher(params.stop or [])
        self.stop_buffer_length = (
            max(self._stops.max_length - 1, 0) if not params.include_stop_str_in_output else 0
        )

    def update(self, new_token_ids: list[int], num_output_tokens: int) -> str | None:
        """Add tokens (num_output_tokens counts them too); return the stop string that ended
        the request, if one did. Tokens after the one that completed it (a step that kept
        several, speculative decoding's) are not read: ``num_unread`` says how many."""
        self.num_unread = 0
        # Without stop strings the text is all there is to do (no scan a token).
        first = num_output_tokens - len(new_token_ids) if self._stops.max_length else None
        for i, token_id in enumerate(new_token_ids):
            piece = self._step(token_id)
            if piece:
                self.output_text += piece
                if first is not None and first + i + 1 >= self.params.min_tokens:
                    stop = self._check_stop_strings(len(piece))
                    if stop is not None:
                        self.num_unread = len(new_token_ids) - i - 1
                        return stop
        return None

    def _step(self, token_id: int) -> str | None:
        try:
            return self._stream.step(self._tokenizer, token_id)
        except Exception as exc:  # tokenizers raises a bare Exception
            if not str(exc).startswith(_INVALID_PREFIX):
                raise
        # Byte-fallback tokenizers (SentencePiece's: Gemma, Llama 2) decode a run of byte
        # tokens as a whole: a stray byte after a complete character turns that character,
        # already sent, into replacement marks, and DecodeStream refuses to take text back.
        # The sent text stays; a fresh stream goes on from this token (as vLLM does), so
        # the request does not fail on a sampled byte.
        self._stream = DecodeStream(skip_special_tokens=self.params.skip_special_tokens)
        return self._stream.step(self._tokenizer, token_id)

    def _check_stop_strings(self, new_chars: int) -> str | None:
        # Only a match that ends in the new text is new; it may span earlier tokens.
        found = self._stops.find(self.output_text, new_chars)
        if found is None:
            return None
        index, stop = found
        if self.params.include_stop_str_in_output:
            index += len(stop)
        self.output_text = self.output_text[:index]
        return stop

    def get_text(self, finished: bool, sent_offset: int) -> str:
        """Text from sent_offset, holding back what could still become a stop string."""
        end = len(self.output_text) if finished else len(self.output_text) - self.stop_buffer_length
        return self.output_text[sent_offset : max(end, sent_offset)]
