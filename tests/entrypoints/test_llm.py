"""LLM.generate / LLM.chat on the bundled model: invariance, sampling, stops, errors."""

from __future__ import annotations

import json
import re

import pytest

from minivllm import LLM, SamplingParams

PROMPTS = [
    "Hello, my name is",
    "The quick brown fox jumps over the lazy dog. Then the dog",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "北京是中国的首都，",
    "Emoji time: 😀🎉",
]
GREEDY = SamplingParams(temperature=0, max_tokens=24)


@pytest.fixture(scope="module")
def llm():
    # Dequantized: the content checks below (e.g. "Paris") rest on float32's near-ties.
    return LLM(max_model_len=512, quantization="none")


@pytest.fixture(scope="module")
def greedy_reference(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def assert_all_blocks_free(llm):
    llm.llm_engine.step()  # an idle step reports the scheduler as it is now
    stats = llm.llm_engine.last_stats
    assert stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0
    assert stats.kv_cache_usage == 0.0


def test_generate_returns_outputs_in_input_order(llm):
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.prompt for o in outputs] == PROMPTS
    for output in outputs:
        assert output.finished
        assert output.outputs[0].finish_reason in ("stop", "length")
        assert output.prompt_token_ids == llm.get_tokenizer().encode(output.prompt)
    assert_all_blocks_free(llm)


def test_generate_builds_each_requests_output_once_and_leaves_the_params_alone(llm, monkeypatch):
    """Only finished outputs are read: one RequestOutput per request (per parent with n > 1),
    none per step, and the caller's SamplingParams keep their output_kind."""
    from minivllm.engine.output_processor import OutputProcessor
    from minivllm.sampling_params import RequestOutputKind

    made = []
    make = OutputProcessor._make_request_output

    def counting(self, *args):
        output = make(self, *args)
        made.append(output is not None)
        return output

    monkeypatch.setattr(OutputProcessor, "_make_request_output", counting)
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=12, n=2, ignore_eos=True)
    outputs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert params.output_kind == RequestOutputKind.CUMULATIVE
    assert [len(o.outputs) for o in outputs] == [2, 2]
    assert all(len(c.token_ids) == 12 and c.text for o in outputs for c in o.outputs)
    assert made == [True] * 4  # the four sequences' last steps only (none asked before)


def test_one_at_a_time_equals_batched(llm, greedy_reference):
    for prompt, expected in zip(PROMPTS, greedy_reference):
        (output,) = llm.generate(prompt, GREEDY, use_tqdm=False)
        assert output.outputs[0].token_ids == expected


@pytest.mark.parametrize("prefill_first", ["1", "0"])
def test_chunked_prefill_mixed_with_decode_equals_batched(
    monkeypatch, prefill_first, greedy_reference
):
    # Both ways to fill a step: prompts alone when requests start, or always mixed. The
    # reference is the module's engine (same settings, every prompt in its first step, where
    # both ways fill it alike), not a third engine started for each.
    monkeypatch.setenv("MINIVLLM_PREFILL_FIRST", prefill_first)
    # quantization="none": chunks change attention's float sums (by ~1e-7), which the int8
    # activations of the GGUF default can round into another greedy token.
    small = LLM(max_model_len=512, max_num_batched_tokens=32, quantization="none")
    long_prompt = " ".join(["the history of the world in many words"] * 12)
    prompts = PROMPTS + [long_prompt]
    outputs = small.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs[: len(PROMPTS)]] == greedy_reference
    assert len(small.get_tokenizer().encode(long_prompt)) > 64  # really chunked
    assert_all_blocks_free(small)


def test_text_equals_decode_of_tokens_for_cjk_and_emoji(llm):
    tokenizer = llm.get_tokenizer()
    for max_tokens in (39, 40):  # one of them cuts an emoji's bytes in half
        params = SamplingParams(temperature=0, max_tokens=max_tokens)
        for output in llm.generate(PROMPTS[3:], params, use_tqdm=False):
            completion = output.outputs[0]
            decoded = tokenizer.decode(completion.token_ids, skip_special_tokens=True)
            # A character whose bytes are not all out yet is held back, never sent broken.
            assert completion.text == decoded.rstrip("\ufffd")
            assert "\ufffd" not in completion.text


def test_seeded_sampling_is_reproducible_across_batches(llm):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=24)
    alone = llm.generate(PROMPTS[0], seeded, use_tqdm=False)[0].outputs[0].token_ids
    again = llm.generate(PROMPTS[0], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=30), GREEDY, seeded.clone()]
    batch = llm.generate(
        PROMPTS[1:3] + [PROMPTS[0]] + PROMPTS[3:4],
        others[:2] + [seeded] + others[2:],
        use_tqdm=False,
    )
    assert alone == again == batch[2].outputs[0].token_ids
    other_seed = SamplingParams(temperature=0.9, top_p=0.95, seed=99, max_tokens=24)
    assert llm.generate(PROMPTS[0], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_top_k_one_equals_greedy(llm, greedy_reference):
    params = SamplingParams(temperature=1.0, top_k=1, max_tokens=24)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == greedy_reference


def test_stop_string_split_across_tokens(llm):
    tokenizer = llm.get_tokenizer()
    prompt = PROMPTS[1]
    full = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0]
    # A stop string made of the end of one token and the start of the next.
    pieces = [tokenizer.decode([t]) for t in full.token_ids]
    i = next(
        i for i in range(2, len(pieces) - 1) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2
    )
    stop = pieces[i][-2:] + pieces[i + 1][:2]
    expected_end = full.text.index(stop)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, stop=[stop]))[0]
    completion = out.outputs[0]
    assert completion.text == full.text[:expected_end]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    with_stop = SamplingParams(
        temperature=0, max_tokens=24, stop=[stop], include_stop_str_in_output=True
    )
    completion = llm.generate(prompt, with_stop, use_tqdm=False)[0].outputs[0]
    assert completion.text == full.text[: expected_end + len(stop)]
    assert_all_blocks_free(llm)


def test_stop_token_ids_and_max_tokens(llm, greedy_reference):
    stop_id = greedy_reference[0][3]
    params = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_id])
    completion = llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
    assert completion.token_ids == greedy_reference[0][: greedy_reference[0].index(stop_id) + 1]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop_id
    short = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=3))[0].outputs[0]
    assert short.token_ids == greedy_reference[0][:3] and short.finish_reason == "length"


def test_min_tokens_suppresses_eos(llm):
    chat = [{"role": "user", "content": "Say hi."}]
    short = llm.chat(chat, SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)
    assert short[0].outputs[0].finish_reason == "stop"  # the model ends with <|im_end|>
    n = len(short[0].outputs[0].token_ids)
    params = SamplingParams(temperature=0, max_tokens=n + 10, min_tokens=n + 5)
    longer = llm.chat(chat, params, use_tqdm=False)[0].outputs[0]
    assert len(longer.token_ids) >= n + 5


def test_chat_applies_the_template(llm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    (output,) = llm.chat(messages, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    expected = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert output.prompt == expected
    assert "<|im_start|>assistant" in output.prompt
    assert "Paris" in output.outputs[0].text
    two = llm.chat([messages, messages], SamplingParams(temperature=0, max_tokens=4))
    assert len(two) == 2


# Shows what the template receives: the tools' names and each message's content.
TOOLS_TEMPLATE = (
    "{% for t in tools or [] %}[tool {{ t['function']['name'] }}]{% endfor %}"
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}{{ c['function']['arguments']['city'] }}{% endfor %}"
    "{% endfor %}"
)


def test_chat_takes_tools_and_content_parts_as_vllms(llm):
    """vLLM's LLM.chat arguments: tools reach the template; a list of text parts is one
    string (chat_template_content_format "auto"/"string"), or kept ("openai"); a tool
    call's JSON arguments reach the template as an object, as the server renders them."""
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    parts = [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]
    call = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    messages = [
        {"role": "user", "content": parts},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": call}],
        },
    ]
    params = SamplingParams(temperature=0, max_tokens=1)
    (output,) = llm.chat(messages, params, tools=[tool], chat_template=TOOLS_TEMPLATE)
    assert output.prompt == "[tool get_weather]<user>Hi\nthere<assistant>Paris"
    (output,) = llm.chat(
        messages[:1], params, chat_template="{{ messages[0]['content'][1]['text'] }}",
        chat_template_content_format="openai",
    )  # fmt: skip
    assert output.prompt == "there"
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(ValueError, match="'image_url' are not supported"):
        llm.chat(image, params)
    with pytest.raises(ValueError, match="chat_template_content_format must be one of"):
        llm.chat(messages, params, chat_template_content_format="xml")


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ("", SamplingParams(), "cannot be empty"),
        ({"prompt_token_ids": []}, SamplingParams(), "cannot be empty"),
        ({"prompt_token_ids": [1] * 600}, SamplingParams(), "longer than the maximum model length"),
        ({"prompt_token_ids": [1, 10**7]}, SamplingParams(), "out-of-vocab token id"),
        ({"prompt_token_ids": [-1]}, SamplingParams(), "out-of-vocab token id"),
    ],
)
def test_bad_prompts_raise_and_the_engine_keeps_serving(
    llm, greedy_reference, prompt, params, message
):
    with pytest.raises(ValueError, match=message):
        llm.generate([PROMPTS[0], prompt], params, use_tqdm=False)
    assert llm.generate(PROMPTS[0], GREEDY)[0].outputs[0].token_ids == greedy_reference[0]
    assert_all_blocks_free(llm)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-3), "top_k"),
        (dict(min_p=2.0), "min_p"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_missing_model_path():
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        LLM("/tmp/does-not-exist/model")


def test_unsupported_architecture(tmp_path):
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 10}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*not supported"):
        LLM(str(tmp_path))


def test_max_model_len_that_does_not_fit_the_kv_cache():
    """The error names the longest max_model_len the cache holds, and that one starts."""
    with pytest.raises(ValueError, match="GiB of KV cache") as info:
        LLM(max_model_len=8192, kv_cache_memory_bytes=4 << 20)
    fits = int(re.search(r"it holds (\d+) tokens", str(info.value)).group(1))
    assert 0 < fits < 8192
    llm = LLM(max_model_len=fits, kv_cache_memory_bytes=4 << 20, enable_multiprocessing=False)
    assert llm.llm_engine.model_config.max_model_len == fits
    with pytest.raises(ValueError, match="GiB of KV cache"):
        LLM(max_model_len=fits + 1, kv_cache_memory_bytes=4 << 20)


def test_priority_needs_the_priority_policy(llm):
    with pytest.raises(ValueError, match="priority scheduling is not enabled"):
        llm.generate(PROMPTS[0], GREEDY, priority=[1], use_tqdm=False)


def test_generation_stops_on_the_models_other_eos_ids(tmp_path, smollm2_tokenizer):
    """A model directory's generation_config.json may list eos ids besides the tokenizer's
    (Llama 3 Instruct's <|eot_id|>): a request stops on them, as in vLLM, unless it ignores
    eos; a request's own stop_token_ids are kept."""
    from tests.conftest import write_tiny_checkpoint

    folder = write_tiny_checkpoint("llama", str(tmp_path), smollm2_tokenizer)
    free = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompt = "Hello, my name is"
    tokens = (
        LLM(folder, max_model_len=64, enable_multiprocessing=False)
        .generate(prompt, free, use_tqdm=False)[0]
        .outputs[0]
        .token_ids
    )
    stop_id = tokens[4]
    config = json.loads((tmp_path / "generation_config.json").read_text())
    config["eos_token_id"] = [smollm2_tokenizer.eos_token_id, stop_id]
    (tmp_path / "generation_config.json").write_text(json.dumps(config))

    llm = LLM(folder, max_model_len=64, enable_multiprocessing=False)
    params = SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[123])
    [stopped] = llm.generate(prompt, params, use_tqdm=False)
    completion = stopped.outputs[0]
    assert completion.token_ids == tokens[: tokens.index(stop_id) + 1]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop_id)
    assert params.stop_token_ids == [123]  # the caller's params are not changed
    assert llm.generate(prompt, free, use_tqdm=False)[0].outputs[0].token_ids == tokens


def test_sampling_defaults_come_from_the_generation_config(tmp_path, smollm2_tokenizer):
    """As vLLM's --generation-config: "auto" takes the model directory's generation_config.json
    sampling fields as the defaults of generate() without params, "vllm" keeps vLLM's own, a
    folder gives its own."""
    from tests.conftest import write_tiny_checkpoint

    folder = write_tiny_checkpoint("llama", str(tmp_path / "model"), smollm2_tokenizer)
    config = json.loads((tmp_path / "model" / "generation_config.json").read_text())
    # top_k 1 samples the argmax whatever the temperature: the defaults give greedy tokens.
    config.update(temperature=0.7, top_k=1, max_new_tokens=5)
    (tmp_path / "model" / "generation_config.json").write_text(json.dumps(config))
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"max_new_tokens": 3}))
    prompt = "Hello, my name is"
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)

    llm = LLM(folder, max_model_len=64, enable_multiprocessing=False)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.7, 1, 5)
    expected = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    for _ in range(2):
        assert llm.generate(prompt, use_tqdm=False)[0].outputs[0].token_ids == expected

    llm = LLM(folder, max_model_len=64, enable_multiprocessing=False, generation_config="vllm")
    assert llm.get_default_sampling_params().max_tokens == SamplingParams().max_tokens == 16
    llm = LLM(folder, max_model_len=64, enable_multiprocessing=False, generation_config=str(other))
    assert llm.get_default_sampling_params().max_tokens == 3
    with pytest.raises(ValueError, match="generation_config must be"):
        LLM(folder, generation_config=str(tmp_path / "nowhere"))


def test_reset_prefix_cache_sleep_and_wake_up_as_vllms(llm, greedy_reference):
    """vLLM's LLM.reset_prefix_cache, sleep (level 1: the KV cache's memory given back) and
    wake_up: the next generate gives the same greedy tokens, asleep or awake."""
    assert llm.reset_prefix_cache() is True
    engine = llm.llm_engine
    llm.sleep()
    assert engine.is_sleeping()
    llm.wake_up()
    assert not engine.is_sleeping()
    llm.sleep()
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)  # a request wakes it
    assert not engine.is_sleeping()
    assert [o.outputs[0].token_ids for o in outputs] == greedy_reference
