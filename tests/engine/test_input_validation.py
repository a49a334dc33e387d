"""Hostile input offline: every SamplingParams / prompt either runs or is refused with a
ValueError, and the engine answers the next request (issue 20, items 1, 3, 4, 6)."""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minivllm import LLM, PoolingParams, SamplingParams
from minivllm.engine.exceptions import EngineDeadError
from minivllm.sampling_params import BeamSearchParams

GOOD = SamplingParams(temperature=0, max_tokens=3)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    engine = LLM(tiny_llama, max_model_len=64, max_num_seqs=8, enforce_eager=True)
    yield engine
    engine.llm_engine.shutdown()


@pytest.fixture(scope="module")
def reference(llm):
    """The greedy answer to the good request, to check the engine still gives it."""
    return llm.generate(["hello"], GOOD)[0].outputs[0].token_ids


def assert_still_serves(llm, reference) -> None:
    assert llm.generate(["hello"], GOOD, use_tqdm=False)[0].outputs[0].token_ids == reference


def vocab(llm) -> int:
    return llm.llm_engine.model_config.vocab_size


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": math.nan}, "temperature must be a finite number"),
        ({"temperature": math.inf}, "temperature must be a finite number"),
        ({"repetition_penalty": math.nan}, "repetition_penalty must be a finite number"),
        ({"top_p": math.nan}, "top_p must be a finite number"),
        ({"presence_penalty": -math.inf}, "presence_penalty must be a finite number"),
        ({"seed": 2**70}, "seed must be in the range of a 64-bit signed integer"),
        ({"seed": -(2**64)}, "seed must be in the range of a 64-bit signed integer"),
        # Wider than msgpack's integers: each failed the client's encoder (an OverflowError
        # out of generate) instead of being the caller's ValueError.
        *(
            ({name: 2**64}, f"{name} must be in the range of a 64-bit signed integer")
            for name in (
                "n",
                "top_k",
                "max_tokens",
                "logprobs",
                "prompt_logprobs",
                "truncate_prompt_tokens",
            )
        ),  # fmt: skip
        ({"min_tokens": 2**64, "max_tokens": None}, "min_tokens must be in the range of a 64"),
        ({"stop_token_ids": [2**64]}, "stop_token_ids contains out-of-vocab token id 1844"),
        ({"allowed_token_ids": [2**63]}, "(token ids must be non-negative, 64-bit)"),
        ({"logit_bias": {str(2**64): 1.0}}, "logit_bias contains out-of-vocab token id"),
        ({"bad_words_token_ids": [[1], [2**64]]}, "bad_words_token_ids contains out-of-vocab"),
        ({"stop": ["\ud800"]}, "stop is not valid UTF-8"),
        ({"bad_words": ["a\udfff"]}, "bad_words is not valid UTF-8"),
        ({"stop_token_ids": [-1]}, "stop_token_ids contains out-of-vocab token id -1"),
        ({"stop_token_ids": ["1"]}, "stop_token_ids must contain integers"),
        ({"temperature": "hot"}, "temperature must be a number"),
        ({"n": 1.5}, "n must be an integer"),
        ({"top_k": -2}, "top_k must be 0 or -1"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias must map token ids"),
        ({"logit_bias": {1: math.nan}}, "logit_bias values must be in [-100, 100]"),
    ],
)
def test_sampling_params_refuses(kwargs, message):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert message in str(info.value)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"beam_width": 2**64}, "beam_width must be in the range of a 64-bit"),
        ({"beam_width": "4"}, "beam_width must be an integer"),
        ({"max_tokens": 2.0}, "max_tokens must be an integer"),
        ({"length_penalty": math.nan}, "length_penalty must be a finite number"),
        ({"temperature": "0"}, "temperature must be a finite number"),
    ],
)
def test_beam_search_params_refuses(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **kwargs})


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"truncate_prompt_tokens": 2**64}, "truncate_prompt_tokens must be in the range of a"),
        ({"dimensions": -(2**64)}, "dimensions must be in the range of a 64-bit"),
    ],
)
def test_pooling_params_refuses(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        PoolingParams(**kwargs)


def test_top_k_over_vocabulary_is_clamped_and_the_engine_lives(llm, reference):
    # Issue 20 item 1: a top_k of the vocabulary size or more used to kill the engine.
    for top_k in (vocab(llm), vocab(llm) + 1, 10**12):
        out = llm.generate(["a"], SamplingParams(top_k=top_k, max_tokens=3, seed=1))
        assert len(out[0].outputs[0].token_ids) == 3
    assert_still_serves(llm, reference)


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ("a", SamplingParams(stop_token_ids=[10**9]), "stop_token_ids contains out-of-vocab"),
        ("a", SamplingParams(allowed_token_ids=[10**9]), "allowed_token_ids contains out-of"),
        ("a", SamplingParams(logprobs=10**9), "Requested logprobs of 1000000000"),
        ("\ud800", GOOD, "The prompt is not valid UTF-8"),
        ({"prompt_token_ids": [1, 10**9]}, GOOD, "prompt_token_ids contains out-of-vocab"),
        ({"prompt_token_ids": [1, True]}, GOOD, "prompt_token_ids must contain integers"),
        ("a " * 200, GOOD, "is longer than the maximum model length"),
    ],
)
def test_engine_refuses_and_serves_the_next(llm, reference, prompt, params, message):
    with pytest.raises(ValueError) as info:
        llm.generate([prompt], params, use_tqdm=False)
    assert message in str(info.value)
    assert_still_serves(llm, reference)


def _floats():
    return st.one_of(
        st.floats(allow_nan=True, allow_infinity=True),
        st.floats(min_value=-3, max_value=3),
        st.sampled_from([0.0, 1e-6, 1e-300, 1.0, 2.0, 1e30]),
    )


def _ints():
    return st.one_of(
        st.integers(min_value=-3, max_value=70),
        st.integers(),
        st.sampled_from([2**63 - 1, 2**63, -(2**63), 2**64, 49152, 49153]),
    )


_TEXT = st.text(alphabet=st.characters(codec=None, exclude_categories=()), max_size=6)

SAMPLING_KWARGS = st.fixed_dictionaries(
    {},
    optional={
        "n": st.integers(min_value=-1, max_value=3),
        "temperature": _floats(),
        "top_p": _floats(),
        "top_k": _ints(),
        "min_p": _floats(),
        "presence_penalty": _floats(),
        "frequency_penalty": _floats(),
        "repetition_penalty": _floats(),
        "seed": st.none() | _ints(),
        "stop": st.none() | _TEXT | st.lists(_TEXT, max_size=3),
        "stop_token_ids": st.lists(_ints(), max_size=3),
        "ignore_eos": st.booleans(),
        "max_tokens": st.none() | st.integers(min_value=-1, max_value=4),
        "min_tokens": st.integers(min_value=-1, max_value=6),
        "logprobs": st.none() | _ints(),
        "prompt_logprobs": st.none() | st.integers(min_value=-2, max_value=5),
        "logit_bias": st.none() | st.dictionaries(_ints(), _floats(), max_size=3),
        "allowed_token_ids": st.none() | st.lists(_ints(), max_size=3),
        "bad_words": st.none() | st.lists(_TEXT, max_size=2),
        "skip_special_tokens": st.booleans(),
    },
)
PROMPTS = st.one_of(
    _TEXT,
    st.fixed_dictionaries({"prompt_token_ids": st.lists(_ints(), max_size=5)}),
)


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(kwargs=SAMPLING_KWARGS, prompt=PROMPTS)
def test_any_input_runs_or_is_refused(llm, reference, kwargs, prompt):
    if kwargs.get("max_tokens", 16) is None:
        kwargs["max_tokens"] = 4  # None means "all the context": keep the example short
    try:
        params = SamplingParams(**kwargs)
        outputs = llm.generate([prompt], params, use_tqdm=False)
    except EngineDeadError:
        raise
    except ValueError:
        pass
    else:
        assert len(outputs) == 1 and len(outputs[0].outputs) == params.n
    assert_still_serves(llm, reference)


@pytest.fixture(scope="module")
def priority_llm(tiny_llama):
    engine = LLM(
        tiny_llama, max_model_len=64, max_num_seqs=8, enforce_eager=True,
        scheduling_policy="priority",
    )  # fmt: skip
    yield engine
    engine.llm_engine.shutdown()


@pytest.mark.parametrize("priority", ["1", 1.5, None, True, 2**63, -(2**63) - 1])
def test_a_priority_the_core_cannot_decode_is_refused(priority_llm, reference, priority):
    # Each passed the frontend under priority scheduling and failed the engine core's
    # decoder, which killed the engine (EngineDeadError for every later request).
    with pytest.raises(ValueError, match="priority must be"):
        priority_llm.generate(["hello"], GOOD, priority=[priority], use_tqdm=False)
    assert_still_serves(priority_llm, reference)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"request_id": 7}, "request_id must be a string, got int"),
        ({"arrival_time": math.nan}, "arrival_time must be a finite number"),
        ({"arrival_time": "now"}, "arrival_time must be a finite number"),
    ],
)
def test_request_fields_the_core_cannot_decode_are_refused(
    priority_llm, reference, fields, message
):
    engine = priority_llm.llm_engine
    request = {"request_id": "fields", "prompt": "hello", "params": GOOD, **fields}
    with pytest.raises(ValueError, match=message):
        engine.add_request(**request)
    assert not engine.has_unfinished_requests()
    assert_still_serves(priority_llm, reference)
