"""Bounded JSON strings rewritten as rule chains (backend_xgrammar.chain_bounded_strings):
the masks must be those of the grammar as xgrammar writes it, at every step of random walks
through the tokens each allows, and filling them must be cheaper."""

from __future__ import annotations

import json
import random
import time

import pytest
import torch
import xgrammar as xgr

from minivllm.model.loader import default_model_path
from minivllm.structured_output import backend_xgrammar as bx
from minivllm.structured_output.backend_xgrammar import XgrammarBackend, chain_bounded_strings
from minivllm.tokenizer import load_tokenizer
from tests.structured_output.schemas import random_schemas

RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 16},
        "code": {"type": "string", "minLength": 3, "maxLength": 3},
        "note": {"type": "string", "maxLength": 5},
        "tags": {"type": "array", "items": {"type": "string", "minLength": 2, "maxLength": 4}},
        "long": {"type": "string", "minLength": 2},  # no maxLength: left as it is
    },
    "required": ["name", "code", "note", "tags", "long"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def backend():
    tokenizer = load_tokenizer(default_model_path())
    return XgrammarBackend(tokenizer, len(tokenizer))


def xgrammar_ebnf(schema: dict) -> str:
    """The grammar as the backend had it before the rewrite (with its string class fix)."""
    grammar = xgr.Grammar.from_json_schema(
        json.dumps(schema), any_whitespace=True, max_whitespace_cnt=bx.MAX_JSON_WHITESPACE
    )
    return str(grammar).replace(bx._BOUNDED_STRING_CLASS, bx._JSON_STRING_CLASS)


def allowed(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    bits = (bitmask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab_size].nonzero().flatten()


def walk_and_compare(backend, schema: dict, steps: int, seed: int) -> int:
    """Random walk through the tokens the rewritten grammar allows: both masks equal at
    every step. Returns the steps walked."""
    ebnf = xgrammar_ebnf(schema)
    assert chain_bounded_strings(ebnf) != ebnf, "nothing was rewritten"
    plain = xgr.GrammarMatcher(backend.compiler.compile_grammar(ebnf))
    chained = backend.matcher(  # (free strings left unbounded: the chains alone compared)
        backend.compile(("json", json.dumps(schema)), max_string_length=0)
    )
    rng = random.Random(seed)
    a, b = backend.allocate_bitmask(1), backend.allocate_bitmask(1)
    for step in range(steps):
        assert plain.is_terminated() == chained.is_terminated()
        if chained.is_terminated():
            return step
        plain.fill_next_token_bitmask(a)
        chained.fill_next_token_bitmask(b)
        assert torch.equal(a, b), f"masks differ at step {step}"
        choices = allowed(b, backend.vocab_size).tolist()
        token = rng.choice(choices)
        assert plain.accept_token(token) and chained.accept_token(token)
    return steps


def test_the_rewrite_names_the_same_strings():
    ebnf = xgrammar_ebnf(RECORD)
    rewritten = chain_bounded_strings(ebnf)
    # The bounded strings (name, code, note, tags' items) became chains; the unbounded one not.
    assert rewritten.count("_chain_") > 0
    assert "{2, -1}" in rewritten
    for bounds in ("1, 16", "3, 3", "0, 5", "2, 4"):
        assert "{" + bounds + "}" in ebnf and "{" + bounds + "}" not in rewritten


def test_masks_equal_along_random_walks(backend):
    for seed in range(4):
        walk_and_compare(backend, RECORD, steps=120, seed=seed)


def test_masks_equal_on_random_schemas(backend):
    # The 200-schema test's generator: strings of 1 to 12 characters among other fields.
    schemas = [s for s in random_schemas(40, seed=3) if '"maxLength"' in json.dumps(s)][:6]
    assert len(schemas) >= 3
    for i, schema in enumerate(schemas):
        walk_and_compare(backend, schema, steps=60, seed=i)


def test_long_strings_are_left_as_they_are():
    limit = bx.MAX_CHAINED_STRING_LENGTH
    schema = {"type": "string", "minLength": 1, "maxLength": limit + 1}
    ebnf = xgrammar_ebnf(schema)
    assert chain_bounded_strings(ebnf) == ebnf


def test_filling_inside_a_bounded_string_is_cheaper(backend):
    """Near the end of its bound, a string's mask took the plain grammar milliseconds (every
    token checked against the stack); the chain takes a fraction of it."""
    schema = {"type": "string", "minLength": 1, "maxLength": 16}
    prefix = '"' + "a" * 12  # four characters left
    seconds = []
    for compiled in (
        backend.compiler.compile_grammar(xgrammar_ebnf(schema)),
        backend.compile(("json", json.dumps(schema))),
    ):
        matcher = xgr.GrammarMatcher(compiled)
        assert matcher.accept_string(prefix)
        bitmask = backend.allocate_bitmask(1)
        start = time.perf_counter()
        for _ in range(20):
            matcher.fill_next_token_bitmask(bitmask)
        seconds.append(time.perf_counter() - start)
    assert seconds[1] < seconds[0] / 4, seconds
