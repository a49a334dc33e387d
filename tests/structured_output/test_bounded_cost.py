"""Structured outputs that end and requests that do not wait on each other: numbers'
digits bounded in JSON grammars (as llama.cpp's), grammars that accept no text refused at
the frontend, several grammars compiled at once, and a compile that takes too long fails
its request alone."""

from __future__ import annotations

import json
import re
import threading
import time

import pytest
import xgrammar as xgr

from minivllm import EngineArgs, StructuredOutputsParams
from minivllm.engine.create_config import create_vllm_config
from minivllm.structured_output.backend_xgrammar import bound_digit_runs
from minivllm.structured_output.grammar import check_grammar
from minivllm.structured_output.manager import StructuredOutputManager
from minivllm.structured_output.request import StructuredOutputRequest


def matches(ebnf: str, text: str) -> bool:
    """Whether the grammar accepts the text, by bytes."""
    vocab = [bytes([i]) for i in range(256)] + [b"</s>"]
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo(vocab, stop_token_ids=[256]))
    matcher = xgr.GrammarMatcher(compiler.compile_grammar(ebnf))
    return all(matcher.accept_token(b) for b in text.encode()) and matcher.is_completed()


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "integer"},
        {"type": "number"},
        {"type": "integer", "minimum": 5},
        {"type": "number", "minimum": 0},
        {"type": "object"},  # json_object: numbers anywhere
    ],
)
def test_numbers_have_at_most_the_bounded_digits(schema):
    ebnf = str(xgr.Grammar.from_json_schema(json.dumps(schema)))
    bounded = bound_digit_runs(ebnf, 4)
    assert "-1}" not in re.sub(r"\w*(items|properties)\w*\{0, -1\}", "", bounded)
    if schema.get("type") == "object":
        value = '{"a": %s}'
        assert matches(bounded, value % "12345") and not matches(bounded, value % "123456")
        assert matches(ebnf, value % "123456")
        return
    assert matches(bounded, "12345") and not matches(bounded, "123456")
    assert matches(ebnf, "123456")  # unbounded before
    if schema == {"type": "number"}:  # (xgrammar bounds a ranged number's fraction itself)
        assert matches(bounded, "1.2345") and not matches(bounded, "1.23456")
        assert matches(bounded, "1.5e1234") and not matches(bounded, "1.5e12345")
    assert bound_digit_runs(ebnf, 0) == ebnf


@pytest.mark.parametrize(
    "constraint",
    [
        dict(grammar="root ::= root"),
        dict(grammar="root ::= a\na ::= a"),
        dict(json={"$ref": "#"}),
        dict(json={"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}),
    ],
)
def test_a_grammar_that_accepts_no_text_is_refused(constraint):
    with pytest.raises(ValueError, match="accepts no text"):
        check_grammar(StructuredOutputsParams(**constraint))


def test_grammars_that_accept_text_pass():
    for constraint in [
        dict(grammar='root ::= ""'),
        dict(grammar='root ::= "a" root | "b"'),
        dict(choice=["yes", "no"]),
        dict(json={"type": "object", "properties": {"x": {"$ref": "#"}}}),
        dict(json_object=True),
    ]:
        check_grammar(StructuredOutputsParams(**constraint))


def test_a_slow_compile_holds_up_no_other_and_times_out():
    """A grammar that compiles for seconds (held here by an event) does not delay a
    yes/no choice behind it; the request waiting on it fails once its time is up."""
    config = create_vllm_config(EngineArgs(max_model_len=256)).model_config
    manager = StructuredOutputManager(config)
    release = threading.Event()
    compile_spec = manager.backend.compile

    def slow(spec, **kwargs):
        if spec[1] == "[ab]+":
            release.wait(30)
        return compile_spec(spec, **kwargs)

    manager.backend.compile = slow
    manager.compile_timeout = 0.5
    try:
        big = manager.new_request(StructuredOutputsParams(regex="[ab]+"))
        small = manager.new_request(StructuredOutputsParams(choice=["yes", "no"]))
        small.compiled.result(timeout=20)
        assert manager.is_ready(small) and not big.compiled.done()
        time.sleep(0.6)
        assert not manager.is_ready(big) and big.failed and "compile" in big.error
    finally:
        release.set()
        manager.shutdown()


def test_a_request_without_a_deadline_waits():
    from concurrent.futures import Future

    request = StructuredOutputRequest(StructuredOutputsParams(regex="a"), Future())
    assert not request.is_ready(lambda compiled: compiled) and not request.failed
