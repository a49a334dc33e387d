"""Structured outputs on the bundled model, offline: JSON schemas, regex, choice, grammar;
every output must parse and validate. Preemption and bad constraints too."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from minivllm import LLM, SamplingParams, StructuredOutputsParams
from tests.structured_output.schemas import random_schemas

PROMPT = "Give me a JSON object:"


@pytest.fixture(scope="module")
def llm():
    llm = LLM(max_model_len=1024)
    yield llm
    llm.llm_engine.shutdown()


def check_json_schemas(llm: LLM, count: int, seed: int = 0) -> None:
    """count schemas, each greedy and sampled: every output parses and validates."""
    schemas = random_schemas(count, seed)
    params = [
        SamplingParams(
            max_tokens=800,
            temperature=temperature,
            seed=i,
            structured_outputs=StructuredOutputsParams(json=schema),
        )
        for i, schema in enumerate(schemas)
        for temperature in (0.0, 1.0)
    ]
    outputs = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    for p, out in zip(params, outputs):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), p.structured_outputs.json)


def test_json_schemas(llm):
    check_json_schemas(llm, 10)


@pytest.mark.slow
def test_200_json_schemas(llm):
    check_json_schemas(llm, 100, seed=1)


def test_regex_choice_grammar_and_json_object(llm):
    cases = [
        (StructuredOutputsParams(regex=r"\d{3}-[a-z]{2,4}"), r"\d{3}-[a-z]{2,4}"),
        (StructuredOutputsParams(choice=["alpha", "beta", 'say "hi"']), r'alpha|beta|say "hi"'),
        (StructuredOutputsParams(grammar='root ::= "x" [0-9] [0-9]?'), r"x[0-9][0-9]?"),
    ]
    for temperature in (0.0, 1.0):
        params = [
            SamplingParams(max_tokens=30, temperature=temperature, seed=3, structured_outputs=c)
            for c, _ in cases
        ]
        outputs = llm.generate(["Answer:"] * len(cases), params, use_tqdm=False)
        for (_, pattern), out in zip(cases, outputs):
            assert re.fullmatch(pattern, out.outputs[0].text), out.outputs[0].text
    out = llm.generate(
        PROMPT,
        SamplingParams(
            max_tokens=200,
            temperature=0,
            structured_outputs=StructuredOutputsParams(json_object=True),
        ),
        use_tqdm=False,
    )
    assert isinstance(json.loads(out[0].outputs[0].text), dict)


def test_constrained_and_free_requests_share_a_batch(llm):
    free = SamplingParams(max_tokens=16, temperature=0)
    alone = llm.generate(["Hello, my name is"], free, use_tqdm=False)[0].outputs[0].text
    outputs = llm.generate(
        ["Hello, my name is", "Answer:"],
        [
            free,
            SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[ab]+")),
        ],
        use_tqdm=False,
    )
    assert outputs[0].outputs[0].text == alone  # the other row's mask does not leak
    assert re.fullmatch("[ab]+", outputs[1].outputs[0].text)


@pytest.mark.parametrize(
    "constraint",
    [
        dict(json={"type": "no-such-type"}),
        dict(json="{not json"),
        dict(regex="(unclosed"),
        dict(grammar="root ::= undefined_rule"),
    ],
)
def test_bad_constraint_is_a_value_error_and_the_engine_lives(llm, constraint):
    with pytest.raises(ValueError):
        llm.generate(
            "x",
            SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(**constraint)),
            use_tqdm=False,
        )
    assert llm.generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].text


def test_params_need_exactly_one_constraint():
    with pytest.raises(ValueError):
        StructuredOutputsParams()
    with pytest.raises(ValueError):
        StructuredOutputsParams(regex="a", choice=["a"])


@pytest.mark.slow
def test_grammar_survives_preemption():
    """A KV cache too small for the batch forces preemptions; resumed requests keep their
    matcher (their tokens are recomputed, the grammar state is not)."""
    llm = LLM(max_model_len=256, kv_cache_memory_bytes=12 * 2**20, max_num_seqs=8)
    try:
        schemas = random_schemas(8, seed=5)
        params = [
            SamplingParams(
                max_tokens=300,
                temperature=1.0,
                seed=i,
                structured_outputs=StructuredOutputsParams(json=s),
            )
            for i, s in enumerate(schemas)
        ]
        outputs = llm.generate([PROMPT * 4] * len(params), params, use_tqdm=False)
        llm.llm_engine.step()  # an idle step refreshes the stats
        assert llm.llm_engine.last_stats.num_preemptions > 0
        for p, out in zip(params, outputs):
            jsonschema.validate(json.loads(out.outputs[0].text), p.structured_outputs.json)
    finally:
        llm.llm_engine.shutdown()
