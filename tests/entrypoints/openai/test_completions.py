"""POST /v1/completions through the official openai client (sync and async, streaming and
not): parameters, usage, n, batched prompts, stop strings, echo, and parity with
LLM.generate."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.entrypoints.openai.conftest import MAX_MODEL_LEN, MODEL_ALIAS, MODEL_NAME
from tests.entrypoints.openai.utils import post_json, request

pytestmark = pytest.mark.e2e

PROMPTS = ["Hello, my name is", "The capital of France is", "def add(a, b):"]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def greedy_reference(offline_llm):
    """LLM.generate's greedy outputs for PROMPTS, as the offline engine computes them."""
    from minivllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outputs = offline_llm.generate(PROMPTS, params, use_tqdm=False)
    return [(o.outputs[0].text, o.outputs[0].token_ids) for o in outputs]


def test_greedy_text_equals_llm_generate(client, greedy_reference):
    for prompt, (text, token_ids) in zip(PROMPTS, greedy_reference):
        completion = client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
        )
        choice = completion.choices[0]
        assert choice.text == text
        assert completion.usage.completion_tokens == len(token_ids)


def test_completion_fields_and_usage(client, smollm2_tokenizer):
    prompt = PROMPTS[0]
    completion = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=5, temperature=0, user="someone"
    )
    assert completion.id.startswith("cmpl-")
    assert completion.object == "text_completion"
    assert completion.model == MODEL_NAME
    assert len(completion.choices) == 1
    choice = completion.choices[0]
    assert choice.index == 0 and choice.finish_reason == "length" and choice.text
    num_prompt_tokens = len(smollm2_tokenizer.encode(prompt))
    assert completion.usage.prompt_tokens == num_prompt_tokens
    assert completion.usage.completion_tokens == 5
    assert completion.usage.total_tokens == num_prompt_tokens + 5


def test_model_alias_and_omitted_model(server, client):
    completion = client.completions.create(model=MODEL_ALIAS, prompt="Hi", max_tokens=2)
    assert completion.model == MODEL_ALIAS
    # vLLM accepts a request without `model`: the first served name answers.
    status, body = post_json(server.url_for("v1", "completions"), {"prompt": "Hi", "max_tokens": 2})
    assert status == 200 and body["model"] == MODEL_NAME


def test_streaming_equals_non_streaming(client):
    kwargs = dict(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0)
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert all(c.usage is None for c in chunks)  # usage only when asked for
    assert len({c.id for c in chunks}) == 1


def test_stream_include_usage(client, smollm2_tokenizer):
    chunks = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt=PROMPTS[0],
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    *token_chunks, last = chunks
    assert last.choices == [] and last.usage is not None
    assert all(c.usage is None for c in token_chunks)
    assert last.usage.prompt_tokens == len(smollm2_tokenizer.encode(PROMPTS[0]))
    assert last.usage.completion_tokens == 6
    assert last.usage.total_tokens == last.usage.prompt_tokens + 6


def test_raw_sse_format(server):
    status, headers, body = request(
        "POST",
        server.url_for("v1", "completions"),
        {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 3, "stream": True},
    )
    assert status == 200
    assert headers["content-type"].startswith("text/event-stream")
    events = [e for e in body.decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    for event in events[:-1]:
        assert json.loads(event.removeprefix("data: "))["object"] == "text_completion"


def test_batched_prompts_with_n(client, smollm2_tokenizer):
    completion = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[:2], max_tokens=4, n=2, temperature=0
    )
    assert [c.index for c in completion.choices] == [0, 1, 2, 3]
    # Greedy: the two samples of a prompt agree; the prompts' answers differ.
    texts = [c.text for c in completion.choices]
    assert texts[0] == texts[1] and texts[2] == texts[3] and texts[0] != texts[2]
    num_prompt_tokens = sum(len(smollm2_tokenizer.encode(p)) for p in PROMPTS[:2])
    assert completion.usage.prompt_tokens == num_prompt_tokens
    assert completion.usage.completion_tokens == 4 * 4


def test_streaming_batched_prompts_with_n(client):
    chunks = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt=PROMPTS[:2],
            max_tokens=3,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts: dict[int, str] = {}
    finished = set()
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] = texts.get(choice.index, "") + choice.text
        if choice.finish_reason is not None:
            finished.add(choice.index)
    assert sorted(texts) == [0, 1, 2, 3] and finished == {0, 1, 2, 3}
    assert chunks[-1].usage.completion_tokens == 12


def test_n_samples_differ_with_temperature(client):
    completion = client.completions.create(
        model=MODEL_NAME, prompt="Once upon a time", max_tokens=12, n=2, temperature=1.0, seed=3
    )
    assert len(completion.choices) == 2
    assert completion.choices[0].text != completion.choices[1].text


def test_token_id_prompts_and_echo(client, smollm2_tokenizer):
    ids = smollm2_tokenizer.encode(PROMPTS[1])
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=4, temperature=0)
    by_text = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=4, temperature=0
    )
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)
    echoed = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=4, temperature=0, echo=True
    )
    assert echoed.choices[0].text == PROMPTS[1] + by_text.choices[0].text
    batch = client.completions.create(
        model=MODEL_NAME, prompt=[ids, ids[:3]], max_tokens=2, temperature=0, echo=True
    )
    assert batch.choices[0].text.startswith(smollm2_tokenizer.decode(ids))
    assert batch.choices[1].text.startswith(smollm2_tokenizer.decode(ids[:3]))


def test_streaming_echo(client):
    chunks = list(
        client.completions.create(
            model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=3, temperature=0, echo=True, stream=True
        )
    )
    assert chunks[0].choices[0].text.startswith(PROMPTS[0])
    full = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=3, temperature=0, echo=True
    )
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text


def test_stop_strings(client):
    base = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0
    ).choices[0]
    stop = base.text.split()[1]  # a word from the middle of the greedy text
    cut = base.text[: base.text.index(stop)]
    for stream in (False, True):
        kwargs = dict(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0)
        if stream:
            chunks = list(client.completions.create(stop=[stop], stream=True, **kwargs))
            text = "".join(c.choices[0].text for c in chunks)
            last = chunks[-1].choices[0]
        else:
            last = client.completions.create(stop=stop, **kwargs).choices[0]
            text = last.text
        assert text == cut
        assert last.finish_reason == "stop"
        assert last.model_extra["stop_reason"] == stop
    kept = client.completions.create(
        stop=[stop],
        extra_body={"include_stop_str_in_output": True},
        model=MODEL_NAME,
        prompt=PROMPTS[0],
        max_tokens=MAX_TOKENS,
        temperature=0,
    ).choices[0]
    assert kept.text == cut + stop


def test_stop_token_ids(client, smollm2_tokenizer):
    base = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0
    )
    ids = smollm2_tokenizer.encode(base.choices[0].text)
    stop_id = ids[2]
    choice = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS[1],
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"stop_token_ids": [stop_id]},
    ).choices[0]
    assert choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == stop_id


def test_seed_makes_sampling_reproducible(client):
    kwargs = dict(model=MODEL_NAME, prompt="My favourite food is", max_tokens=6, temperature=1.0)
    first = client.completions.create(seed=1234, **kwargs).choices[0].text
    second = client.completions.create(seed=1234, **kwargs).choices[0].text
    assert first == second


def test_sampling_parameters_are_accepted(client):
    completion = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS[2],
        max_tokens=6,
        temperature=0.7,
        top_p=0.9,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        seed=7,
        extra_body={
            "top_k": 20,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "min_tokens": 6,
            "ignore_eos": True,
            "skip_special_tokens": False,
            "priority": 0,
            "cache_salt": "a-tenant's-secret",  # (its effect: test_llm_prefix_caching.py)
        },
    )
    assert completion.usage.completion_tokens == 6
    assert completion.choices[0].finish_reason == "length"


def test_max_tokens_default_and_null(server, smollm2_tokenizer):
    url = server.url_for("v1", "completions")
    status, body = post_json(url, {"model": MODEL_NAME, "prompt": PROMPTS[0]})
    assert status == 200
    assert body["usage"]["completion_tokens"] <= 16  # OpenAI's default for completions
    # null: as much as the context leaves (here: the whole context, ignoring EOS).
    prompt_ids = smollm2_tokenizer.encode(PROMPTS[0])
    long_prompt = prompt_ids * ((MAX_MODEL_LEN - 4) // len(prompt_ids))
    status, body = post_json(
        url,
        {"model": MODEL_NAME, "prompt": long_prompt, "max_tokens": None, "ignore_eos": True},
    )
    assert status == 200
    assert body["usage"]["total_tokens"] == MAX_MODEL_LEN


def test_logprobs(client):
    kwargs = dict(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=3)
    completion = client.completions.create(**kwargs)
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 4
    assert "".join(logprobs.tokens) == completion.choices[0].text
    offsets = [sum(len(t) for t in logprobs.tokens[:i]) for i in range(4)]
    assert logprobs.text_offset == offsets
    for token, value, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert value <= 0.0
        assert len(top) == 3 and token in top
        assert max(top.values()) == pytest.approx(value)  # greedy: the sampled one is the best
    chunks = list(client.completions.create(stream=True, **kwargs))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs is not None]
    assert sum((lp.tokens for lp in streamed), []) == logprobs.tokens
    assert sum((lp.text_offset for lp in streamed), []) == logprobs.text_offset
    assert sum((lp.token_logprobs for lp in streamed), []) == pytest.approx(logprobs.token_logprobs)


def test_echo_with_logprobs_and_prompt_logprobs(client, smollm2_tokenizer):
    ids = smollm2_tokenizer.encode(PROMPTS[1])
    completion = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS[1],
        max_tokens=2,
        temperature=0,
        logprobs=1,
        echo=True,
        extra_body={"prompt_logprobs": 2, "return_tokens_as_token_ids": True},
    )
    choice = completion.choices[0]
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(ids) + 2
    assert logprobs.tokens[: len(ids)] == [f"token_id:{t}" for t in ids]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(v <= 0.0 for v in logprobs.token_logprobs[1:])
    prompt_logprobs = choice.model_extra["prompt_logprobs"]
    assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
    for token_id, step in zip(ids[1:], prompt_logprobs[1:]):
        assert str(token_id) in step  # the prompt's own token, then the top 2
        assert 2 <= len(step) <= 3
        assert {"logprob", "rank", "decoded_token"} <= set(step[str(token_id)])


def test_logit_bias_allowed_tokens_and_bad_words(client, smollm2_tokenizer):
    forced = smollm2_tokenizer.encode(" banana", add_special_tokens=False)[0]
    biased = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=3, temperature=0,
        logit_bias={str(forced): 100},
    )  # fmt: skip
    assert biased.choices[0].text == smollm2_tokenizer.decode([forced] * 3)
    allowed = smollm2_tokenizer.encode(" yes no", add_special_tokens=False)
    only = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=4, temperature=0,
        extra_body={"allowed_token_ids": allowed},
    )  # fmt: skip
    assert set(only.choices[0].text.split()) <= {"yes", "no"}
    base = (
        client.completions.create(
            model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0
        )
        .choices[0]
        .text
    )
    word = base.split()[0].strip(",.")
    banned = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"bad_words": [word]},
    ).choices[0].text  # fmt: skip
    assert word not in banned


def test_async_client(server):
    async def main():
        client = server.get_async_client()
        kwargs = dict(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=4, temperature=0)
        completion = await client.completions.create(**kwargs)
        stream = await client.completions.create(stream=True, **kwargs)
        text = "".join([chunk.choices[0].text async for chunk in stream])
        assert text == completion.choices[0].text

    asyncio.run(main())


def test_async_concurrent_requests_do_not_mix(server, greedy_reference):
    async def main():
        client = server.get_async_client()

        async def one(prompt):
            completion = await client.completions.create(
                model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
            )
            return completion.choices[0].text

        return await asyncio.gather(*(one(p) for p in PROMPTS * 2))

    texts = asyncio.run(main())
    assert texts == [text for text, _ in greedy_reference] * 2
