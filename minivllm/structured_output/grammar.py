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
            xgr.Grammar.from_json_schema(text, any_whitespace=any_whitespace)
        elif kind == "regex":
            xgr.Grammar.from_regex(text)
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(text)
    except Exception as e:  # xgrammar raises RuntimeError or its own errors
        return f"Invalid {kind} for structured outputs: {e}"
    return None
