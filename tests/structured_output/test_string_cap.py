"""The default bound on JSON strings that have no maxLength
(StructuredOutputsConfig.json_max_string_length, backend_xgrammar.bound_free_strings): such a
string closes after the cap, an escape counting as one character; a schema's own maxLength
wins, larger or smaller; object keys are bounded too; 0 leaves strings unbounded; the engine
argument reaches the engine's grammars."""

from __future__ import annotations

import json

import pytest

from minivllm import LLM, EngineArgs, SamplingParams, StructuredOutputsParams
from minivllm.config import StructuredOutputsConfig
from minivllm.engine.create_config import create_vllm_config
from minivllm.model.loader import default_model_path
from minivllm.structured_output.backend_xgrammar import XgrammarBackend
from minivllm.structured_output.manager import StructuredOutputManager
from minivllm.tokenizer import load_tokenizer

CAP = 8


@pytest.fixture(scope="module")
def backend():
    tokenizer = load_tokenizer(default_model_path())
    return XgrammarBackend(tokenizer, len(tokenizer))


def matcher(backend, schema: dict | None, cap: int = CAP):
    spec = ("json_object", "") if schema is None else ("json", json.dumps(schema))
    return backend.matcher(backend.compile(spec, max_string_length=cap))


def one_string(**bounds) -> dict:
    return {
        "type": "object",
        "properties": {"notes": {"type": "string", **bounds}},
        "required": ["notes"],
    }


def test_a_string_without_max_length_closes_after_the_cap(backend):
    m = matcher(backend, one_string())
    assert m.accept_string('{"notes": "' + "x" * CAP)
    assert not m.accept_string("x"), "a character past the cap was accepted"
    assert m.accept_string('"}')
    assert m.is_completed()


def test_an_escape_counts_as_one_character(backend):
    m = matcher(backend, one_string())
    assert m.accept_string('{"notes": "' + '\\"' * CAP)  # 8 escaped quotes: 8 characters
    assert not m.accept_string("\\n")
    assert m.accept_string('"}')


def test_a_schemas_own_max_length_wins_larger_or_smaller(backend):
    m = matcher(backend, one_string(maxLength=3 * CAP))
    assert m.accept_string('{"notes": "' + "x" * 3 * CAP)
    assert not m.accept_string("x")
    m = matcher(backend, one_string(maxLength=2))
    assert m.accept_string('{"notes": "xx')
    assert not m.accept_string("x")


def test_a_min_length_only_string_is_capped_but_keeps_its_minimum(backend):
    m = matcher(backend, one_string(minLength=2))
    assert m.accept_string('{"notes": "' + "x" * CAP)
    assert not m.accept_string("x")
    m = matcher(backend, one_string(minLength=3 * CAP))
    assert m.accept_string('{"notes": "' + "x" * 3 * CAP)
    assert not m.accept_string("x")


def test_json_object_keys_and_values_are_capped(backend):
    m = matcher(backend, None)
    assert m.accept_string('{"' + "k" * CAP)
    assert not m.accept_string("k")
    m = matcher(backend, None)
    assert m.accept_string('{"k": "' + "v" * CAP)
    assert not m.accept_string("v")
    assert m.accept_string('"}')


def test_zero_leaves_strings_unbounded(backend):
    m = matcher(backend, one_string(), cap=0)
    assert m.accept_string('{"notes": "' + "x" * 2000)
    assert m.accept_string('"}')


def test_the_config_parses_and_refuses_bad_values():
    assert StructuredOutputsConfig.parse(None).json_max_string_length == 256
    parsed = StructuredOutputsConfig.parse('{"json_max_string_length": 0}')
    assert parsed.json_max_string_length == 0
    for bad in ('{"json_max_string_length": -1}', '{"json_max_string_length": "9"}'):
        with pytest.raises(ValueError, match="json_max_string_length"):
            StructuredOutputsConfig.parse(bad)
    with pytest.raises(ValueError, match="Unknown"):
        StructuredOutputsConfig.parse({"max_length": 3})
    config = create_vllm_config(EngineArgs(structured_outputs_config={"json_max_string_length": 5}))
    assert config.structured_outputs_config.json_max_string_length == 5


def test_the_engine_argument_bounds_sampled_strings():
    """Sampled at temperature 1.5 into a free-text field: every reply parses, and its text
    is at most the engine's cap (three characters: the model's words run longer)."""
    llm = LLM(max_model_len=256, structured_outputs_config={"json_max_string_length": 3})
    try:
        params = [
            SamplingParams(
                max_tokens=40,
                temperature=1.5,
                seed=seed,
                structured_outputs=StructuredOutputsParams(json=one_string()),
            )
            for seed in range(6)
        ]
        outputs = llm.generate(["Describe your day in JSON:"] * len(params), params)
        notes = [json.loads(out.outputs[0].text)["notes"] for out in outputs]
    finally:
        llm.llm_engine.shutdown()
    assert all(len(n) <= 3 for n in notes), notes
    assert any(len(n) == 3 for n in notes), notes  # the cap, not the model, ended them


def test_a_free_string_takes_at_most_a_quarter_of_the_reply():
    manager = StructuredOutputManager(
        create_vllm_config(EngineArgs()).model_config, StructuredOutputsConfig(256)
    )
    assert manager.string_cap(None) == 256
    assert manager.string_cap(4096) == 256
    assert manager.string_cap(200) == 50
    assert manager.string_cap(2) == 1  # never 0, which would mean unbounded
    unbounded = StructuredOutputManager(manager.model_config, StructuredOutputsConfig(0))
    assert unbounded.string_cap(200) == 0
