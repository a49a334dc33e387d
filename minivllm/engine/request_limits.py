"""Bounds on what one request may ask of the engine, checked by the Processor (for LLM and the
server alike) before anything reaches the engine core: each refused with a ValueError naming
the parameter (a 400 from the server).

The engine's per-token work on stop strings, bad words and logit bias, and a grammar's
compilation, grow with these; the bounds keep one request from stalling the others.
"""

from __future__ import annotations

import json
from typing import Any

from minivllm.engine.exceptions import VLLMValidationError

MAX_STOP_STRINGS = 1024
MAX_STOP_STRING_CHARS = 1024
MAX_BAD_WORDS = 1024
MAX_BAD_WORD_CHARS = 1024
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_STOP_TOKEN_IDS = 1024
# Nesting of a JSON schema's objects and arrays (a property's schema nests two: the
# "properties" object and the schema itself); deeper schemas compile slowly, if at all.
MAX_SCHEMA_DEPTH = 64
# A regex or grammar's length in characters.
MAX_GRAMMAR_CHARS = 100_000


def check_request_bounds(params: Any) -> None:
    """Refuse SamplingParams that ask for more than the bounds above."""
    _check_strings(params.stop, "stop", MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS)
    _check_strings(params.bad_words, "bad_words", MAX_BAD_WORDS, MAX_BAD_WORD_CHARS)
    _check_count(params.logit_bias, "logit_bias", MAX_LOGIT_BIAS_ENTRIES)
    _check_count(params.stop_token_ids, "stop_token_ids", MAX_STOP_TOKEN_IDS)
    constraint = params.structured_outputs
    if constraint is None:
        return
    if constraint.json is not None:
        schema = constraint.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except (json.JSONDecodeError, RecursionError):
                return  # the grammar check says what is wrong with it
        if json_depth(schema) > MAX_SCHEMA_DEPTH:
            raise VLLMValidationError(
                f"The JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels.",
                parameter="structured_outputs",
            )
    for name in ("regex", "grammar"):
        text = getattr(constraint, name, None)
        if isinstance(text, str) and len(text) > MAX_GRAMMAR_CHARS:
            raise VLLMValidationError(
                f"The {name} is longer than {MAX_GRAMMAR_CHARS} characters.",
                parameter="structured_outputs",
            )


def json_depth(value: Any) -> int:
    """How deeply objects and arrays nest in a JSON value (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def _check_count(values, name: str, most: int) -> None:
    if values and len(values) > most:
        raise VLLMValidationError(
            f"{name} has {len(values)} entries; at most {most} are allowed.", parameter=name
        )


def _check_strings(values, name: str, most: int, most_chars: int) -> None:
    _check_count(values, name, most)
    for value in values or ():
        if len(value) > most_chars:
            raise VLLMValidationError(
                f"{name} has a string of {len(value)} characters; at most {most_chars} are "
                "allowed.",
                parameter=name,
            )
