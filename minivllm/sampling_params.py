"""SamplingParams: how one request is sampled and when it stops (vLLM's fields and defaults)."""

from __future__ import annotations

import enum
import math
from numbers import Integral, Real

import msgspec

from minivllm.slo_params import SLOParams

_SAMPLING_EPS = 1e-5
# Every integer crosses to the engine core as msgpack, whose integers are 64-bit (and seeds go
# to torch.Generator.manual_seed, as vLLM's): each must fit a signed 64-bit integer, or the
# request fails in the client's encoder instead of as the caller's error.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Float fields: each must be a finite number (NaN passes every comparison check unnoticed).
_FLOAT_FIELDS = (
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "temperature",
    "top_p",
    "min_p",
)
# Integer fields that may also be None.
_INT_FIELDS = ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs",
               "truncate_prompt_tokens")  # fmt: skip


def is_int(value) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def check_utf8(text: str, name: str) -> None:
    """Refuse a string that cannot be encoded as UTF-8 (a lone surrogate such as "\\ud800"),
    which no tokenizer can take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{name} is not valid UTF-8: it contains {text[exc.start : exc.end]!r} at "
            f"position {exc.start} (a lone surrogate)."
        ) from None


def check_int(value, name: str) -> None:
    """An integer (not a bool) that fits a signed 64-bit one, as the engine core decodes it."""
    if not is_int(value):
        raise ValueError(f"{name} must be an integer, got {value!r}.")
    if not INT64_MIN <= value <= INT64_MAX:
        raise ValueError(
            f"{name} must be in the range of a 64-bit signed integer "
            f"[{INT64_MIN}, {INT64_MAX}], got {value}."
        )


def check_finite_number(value, name: str) -> None:
    if not isinstance(value, Real) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}.")


def check_token_ids(ids, name: str, vocab_size: int | None = None) -> None:
    """Every id an integer, and inside the vocabulary when its size is known (else at
    least inside a 64-bit integer)."""
    end = vocab_size if vocab_size is not None else INT64_MAX + 1
    for token_id in ids:
        if not is_int(token_id):
            raise ValueError(f"{name} must contain integers, got {token_id!r}.")
        if not 0 <= token_id < end:
            limit = f"[0, {vocab_size})" if vocab_size is not None else "non-negative, 64-bit"
            raise ValueError(
                f"{name} contains out-of-vocab token id {token_id} (token ids must be {limit})."
            )


class RequestOutputKind(enum.IntEnum):
    CUMULATIVE = 0  # every output carries all text and tokens so far
    DELTA = 1  # every output carries only what is new since the last one
    FINAL_ONLY = 2  # one output, when the request finishes


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True):
    """Constrain the output to a JSON schema, a regex, a choice or an EBNF grammar (vLLM's).

    Exactly one of json, regex, choice, grammar, json_object is set."""

    json: str | dict | None = None  # a JSON schema (a dict or its JSON text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (xgrammar's GBNF dialect)
    json_object: bool | None = None  # any JSON object
    disable_any_whitespace: bool = False
    # Set by the server when a reasoning parser runs: the constraint starts after this text
    # (e.g. "</think>") appears in the output.
    reasoning_end: str | None = None

    def __post_init__(self) -> None:
        kinds = [
            k
            for k in ("json", "regex", "choice", "grammar", "json_object")
            if getattr(self, k) not in (None, False)
        ]
        if len(kinds) != 1:
            raise ValueError(
                "Exactly one of json, regex, choice, grammar, json_object must be set in "
                f"structured_outputs, got {kinds or 'none'}."
            )
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) for c in self.choice)
        ):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings.")
        if isinstance(self.json, dict):
            # The schema crosses to the engine core as msgpack, whose integers are 64-bit: one
            # with a wider integer (valid JSON) is refused here, as the request's own error,
            # not left to fail the client's encoder (a 500 for an Ollama `format` or a
            # response_format that held one).
            try:
                msgspec.msgpack.encode(self.json)
            except (OverflowError, TypeError) as err:
                raise ValueError(
                    f"structured_outputs.json is not a usable schema: {err}."
                ) from None


class SamplingParams(msgspec.Struct, omit_defaults=True):
    """Sampling parameters for text generation, with vLLM's names, defaults and checks.

    A msgspec struct so that it crosses the process boundary as compact msgpack.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # Filled by the frontend from bad_words with its tokenizer (as vLLM does).
    bad_words_token_ids: list[list[int]] | None = None
    # minivllm's: the request's latency class and targets (the `slo` scheduling policy's);
    # None is best-effort.
    slo_params: SLOParams | None = None

    def __post_init__(self) -> None:
        self._verify_types()
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:  # vLLM accepts -1 as "off" too
            self.top_k = 0
        self._verify()
        if self.temperature < _SAMPLING_EPS:
            # Greedy: the other sampling knobs have no effect; normalise them like vLLM.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _verify_types(self) -> None:
        """Types first, so that the range checks below compare numbers with numbers."""
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, Real) or isinstance(value, bool):
                raise ValueError(f"{name} must be a number, got {value!r}.")
            if not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value}.")
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if value is not None:
                check_int(value, name)
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if stop is not None:
            if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
                raise ValueError(f"stop must be a string or a list of strings, got {stop!r}.")
            for text in stop:
                check_utf8(text, "stop")
        if self.bad_words is not None:
            if not isinstance(self.bad_words, (list, tuple)) or not all(
                isinstance(w, str) for w in self.bad_words
            ):
                raise ValueError("bad_words must be a list of strings.")
            for word in self.bad_words:
                check_utf8(word, "bad_words")
        for name in ("stop_token_ids", "allowed_token_ids"):
            ids = getattr(self, name)
            if ids is not None:
                if not isinstance(ids, (list, tuple)):
                    raise ValueError(f"{name} must be a list of integers, got {ids!r}.")
                check_token_ids(ids, name)
        if self.bad_words_token_ids is not None:
            for ids in self.bad_words_token_ids:
                check_token_ids(ids, "bad_words_token_ids")
        if self.slo_params is not None and not isinstance(self.slo_params, SLOParams):
            raise ValueError(f"slo_params must be SLOParams, got {self.slo_params!r}.")
        if self.logit_bias is not None and not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias must be a dict, got {type(self.logit_bias).__name__}.")

    def _verify(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if self.repetition_penalty <= 0.0:
            raise ValueError(
                f"repetition_penalty must be greater than zero, got {self.repetition_penalty}."
            )
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 or -1 (disable), or at least 1, got {self.top_k}.")
        # (top_k above the vocabulary size is clamped to it by the processor, as vLLM does.)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            raise ValueError(
                f"min_tokens must be greater than or equal to 0, got {self.min_tokens}."
            )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}."
            )
        if self.logprobs is not None and self.logprobs < -1:
            raise ValueError(f"logprobs must be non-negative or -1, got {self.logprobs}.")
        if self.prompt_logprobs is not None and self.prompt_logprobs < -1:
            raise ValueError(
                f"prompt_logprobs must be non-negative or -1, got {self.prompt_logprobs}."
            )
        if any(not s for s in self.stop):
            raise ValueError("stop cannot contain an empty string.")
        if self.logit_bias is not None:
            # JSON clients send token ids as strings.
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError, OverflowError):
                raise ValueError("logit_bias must map token ids (integers) to numbers.") from None
            check_token_ids(self.logit_bias, "logit_bias")
            bad = [v for v in self.logit_bias.values() if not -100.0 <= v <= 100.0]
            if bad:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bad[0]}.")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids is not allowed to be empty.")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1:
            raise ValueError(
                f"truncate_prompt_tokens must be >= 1, got {self.truncate_prompt_tokens}."
            )

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or bool(self.presence_penalty)
            or bool(self.frequency_penalty)
        )

    @property
    def reads_own_outputs(self) -> bool:
        """Whether sampling the next token reads the request's earlier ones on the host:
        penalties, min_tokens, bad words, a grammar (async scheduling steps one at a time
        while such a request runs)."""
        return bool(
            self.uses_penalties
            or self.min_tokens
            or self.bad_words_token_ids
            or self.structured_outputs is not None
        )

    @property
    def sampling_type_greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    def clone(self) -> SamplingParams:
        return msgspec.structs.replace(self)


class BeamSearchParams(msgspec.Struct, omit_defaults=True):
    """Beam search parameters for `LLM.beam_search`, as vLLM's."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            check_int(getattr(self, name), name)
        for name in ("temperature", "length_penalty"):
            check_finite_number(getattr(self, name), name)
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be at least 1, got {self.beam_width}.")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
