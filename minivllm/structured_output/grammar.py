"""One grammar spec per StructuredOutputsParams: the cache key, and the frontend's check."""

from __future__ import annotations

import functools
import json

from minivllm.sampling_params import StructuredOutputsParams

# (kind, text): kind is "json", "json_object", "regex" or "grammar" (EBNF).
GrammarSpec = tuple[str, str]


def grammar_spec(params: StructuredOutputsParams) -> GrammarSpec:
    """The canonical form of a constraint: equal constraints give equal specs (the cache key)."""
    if params.json is not None:
        schema = params.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"The JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict | bool):
            raise ValueError("The JSON schema must be a JSON object.")
        # Key order is kept: it is the order the properties are generated in.
        return "json", json.dumps(schema)
    if params.json_object:
        return "json_object", ""
    if params.regex is not None:
        return "regex", params.regex
    if params.choice is not None:
        # JSON string escapes are valid EBNF string-literal escapes.
        return "grammar", "root ::= " + " | ".join(json.dumps(c) for c in params.choice)
    return "grammar", params.grammar


def check_grammar(params: StructuredOutputsParams) -> None:
    """Parse the constraint without a tokenizer; raise ValueError with the reason if it
    cannot compile. Runs in the frontend, so a bad schema never reaches the engine."""
    kind, text = grammar_spec(params)
    error = _grammar_error(kind, text, not params.disable_any_whitespace)
    if error is not None:
        raise ValueError(error)


@functools.lru_cache(maxsize=256)
def _grammar_error(kind: str, text: str, any_whitespace: bool) -> str | None:
    """Why the spec cannot compile, or None. Cached: clients send the same schema with
    every request, and parsing it again (or failing again) would be wasted work."""
    import xgrammar as xgr

    try:
        if kind == "json":
            grammar = xgr.Grammar.from_json_schema(text, any_whitespace=any_whitespace)
        elif kind == "regex":
            grammar = xgr.Grammar.from_regex(text)
        elif kind == "grammar":
            grammar = xgr.Grammar.from_ebnf(text)
        else:
            return None
        if not _accepts_some_text(grammar):
            return (
                f"The {kind} for structured outputs accepts no text at all (a rule or $ref "
                "that only refers to itself?): the reply could not follow it."
            )
    except Exception as e:  # xgrammar raises RuntimeError or its own errors
        return f"Invalid {kind} for structured outputs: {e}"
    return None


@functools.cache
def _byte_compiler():
    """A grammar compiler for a vocabulary of the 256 bytes and a stop token: compiling for
    it is quick, and any text is a sequence of its tokens."""
    import xgrammar as xgr

    vocab = [bytes([i]) for i in range(256)] + [b"</s>"]
    info = xgr.TokenizerInfo(vocab, stop_token_ids=[256])
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def _accepts_some_text(grammar) -> bool:
    """Whether the grammar's first character can be anything or it accepts the empty text:
    false for a grammar whose start only refers to itself (``root ::= root``, a JSON
    schema that is a ``$ref`` to itself), which would leave every token forbidden."""
    import numpy as np
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(_byte_compiler().compile_grammar(grammar))
    if matcher.is_completed():
        return True
    mask = xgr.allocate_token_bitmask(1, 257)
    matcher.fill_next_token_bitmask(mask)
    return bool(np.any(mask.numpy()[0] != 0))
