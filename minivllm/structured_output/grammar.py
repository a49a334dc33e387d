"""One grammar spec per StructuredOutputsParams: the cache key, and the frontend's check."""

from __future__ import annotations

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
    import xgrammar as xgr

    kind, text = grammar_spec(params)
    try:
        if kind == "json":
            xgr.Grammar.from_json_schema(text, any_whitespace=not params.disable_any_whitespace)
        elif kind == "regex":
            xgr.Grammar.from_regex(text)
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(text)
    except Exception as e:  # xgrammar raises RuntimeError or its own errors
        raise ValueError(f"Invalid {kind} for structured outputs: {e}") from None
