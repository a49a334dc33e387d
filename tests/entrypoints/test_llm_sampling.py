"""SamplingParams end to end on the real model: logprobs, penalties, n, biases, bans."""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams

PROMPT = "The three primary colors are"


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=512, quantization="none")  # compared with HF's logprobs


def hf_logprobs(hf, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = hf(torch.tensor([token_ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def assert_position_matches(position, reference: torch.Tensor, chosen: int, k: int):
    """One position's Logprob dict against the reference distribution."""
    assert chosen in position
    torch.testing.assert_close(
        position[chosen].logprob, reference[chosen].item(), atol=1e-4, rtol=0
    )
    assert position[chosen].rank == int((reference > reference[chosen]).sum()) + 1
    top = reference.topk(k)
    for rank, (token_id, value) in enumerate(zip(top.indices.tolist(), top.values.tolist()), 1):
        assert token_id in position, (token_id, position)
        assert abs(position[token_id].logprob - value) < 1e-4
        if token_id != chosen:
            assert position[token_id].rank == rank
    assert len(position) in (k, k + 1)


def test_logprobs_and_prompt_logprobs_match_transformers(llm, smollm2_hf):
    k = 5
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=k, prompt_logprobs=k)
    (output,) = llm.generate(PROMPT, params, use_tqdm=False)
    completion = output.outputs[0]
    prompt_ids, out_ids = output.prompt_token_ids, completion.token_ids
    reference = hf_logprobs(smollm2_hf, prompt_ids + out_ids)
    assert len(completion.logprobs) == len(out_ids)
    for t, (position, token_id) in enumerate(zip(completion.logprobs, out_ids)):
        assert_position_matches(position, reference[len(prompt_ids) - 1 + t], token_id, k)
        assert position[token_id].decoded_token == llm.get_tokenizer().decode([token_id])
    expected_cumulative = sum(completion.logprobs[t][i].logprob for t, i in enumerate(out_ids))
    assert completion.cumulative_logprob == pytest.approx(expected_cumulative)
    assert output.prompt_logprobs[0] is None
    assert len(output.prompt_logprobs) == len(prompt_ids)
    for p in range(1, len(prompt_ids)):
        assert_position_matches(output.prompt_logprobs[p], reference[p - 1], prompt_ids[p], k)


def test_prompt_logprobs_across_chunked_prefill(smollm2_hf):
    small = LLM(max_model_len=512, max_num_batched_tokens=16, quantization="none")
    prompt = " ".join(["a long prompt that spans several chunks"] * 5)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    (output,) = small.generate(prompt, params, use_tqdm=False)
    ids = output.prompt_token_ids
    assert len(ids) > 32
    reference = hf_logprobs(smollm2_hf, ids)
    for p in range(1, len(ids)):
        assert_position_matches(output.prompt_logprobs[p], reference[p - 1], ids[p], 2)


def test_repetition_penalty_matches_transformers(llm, smollm2_hf):
    ids = llm.get_tokenizer().encode(PROMPT)
    with torch.inference_mode():
        hf = smollm2_hf.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=32,
            do_sample=False,
            repetition_penalty=1.3,
            pad_token_id=2,
        )[0, len(ids) :].tolist()
    params = SamplingParams(temperature=0, max_tokens=32, repetition_penalty=1.3)
    assert llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids == hf


def test_n_samples_are_reproducible_and_share_the_prompt(llm):
    prompt = "Write a list of fruits: apple, banana," + " cherry," * 20
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=12)
    before = llm.llm_engine.get_stats()
    first = llm.generate(prompt, params, use_tqdm=False)[0]
    after = llm.llm_engine.get_stats()
    second = llm.generate(prompt, params, use_tqdm=False)[0]
    assert len(first.outputs) == 4
    assert [c.index for c in first.outputs] == [0, 1, 2, 3]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in second.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1
    # The prompt's full blocks were computed once: the other three samples hit the cache.
    prompt_len = len(first.prompt_token_ids)
    full_blocks = (prompt_len - 1) // 16 * 16
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    assert hits >= 3 * full_blocks > 0


def test_logit_bias_and_allowed_token_ids(llm):
    tokenizer = llm.get_tokenizer()
    target = tokenizer.encode(" banana")[0]
    params = SamplingParams(temperature=0, max_tokens=3, logit_bias={target: 100})
    assert llm.generate(PROMPT, params)[0].outputs[0].token_ids == [target] * 3
    allowed = tokenizer.encode(" red green blue")
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=6, allowed_token_ids=allowed)
    assert set(llm.generate(PROMPT, params)[0].outputs[0].token_ids) <= set(allowed)


def test_bad_words_are_never_generated(llm):
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16))[0].outputs[0]
    word = greedy.text.split()[0].strip(",.:")
    params = SamplingParams(temperature=0, max_tokens=16, bad_words=[word])
    text = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].text
    assert word not in text.split()


def test_truncate_prompt_tokens_keeps_the_end(llm):
    ids = llm.get_tokenizer().encode(PROMPT)
    params = SamplingParams(temperature=0, max_tokens=2, truncate_prompt_tokens=3)
    assert llm.generate(PROMPT, params)[0].prompt_token_ids == ids[-3:]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(n=0), "n"),
        (dict(presence_penalty=3), "presence_penalty"),
        (dict(frequency_penalty=-2.5), "frequency_penalty"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(logprobs=-2), "logprobs"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
        (dict(logit_bias={1: 200}), "logit_bias"),
        (dict(allowed_token_ids=[]), "allowed_token_ids"),
        (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    ],
)
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_out_of_vocab_ids_in_params_are_rejected(llm):
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate(PROMPT, SamplingParams(allowed_token_ids=[10**8]))
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(PROMPT, SamplingParams(logit_bias={10**8: 1.0}))


def hf_beam_search(hf, ids: list[int], beams: int, max_new: int) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            num_beams=beams,
            do_sample=False,
            max_new_tokens=max_new,
            pad_token_id=2,
        )
    return out[0, len(ids) :].tolist()


def test_beam_search_width_one_is_greedy(llm):
    from minivllm.sampling_params import BeamSearchParams

    greedy = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=10))[0]
    (out,) = llm.beam_search([PROMPT], BeamSearchParams(beam_width=1, max_tokens=10))
    best = out.sequences[0]
    assert best.tokens == greedy.prompt_token_ids + greedy.outputs[0].token_ids


def test_beam_search_matches_transformers(llm, smollm2_hf):
    from minivllm.sampling_params import BeamSearchParams

    prompts = ["The capital of France is", "def add(a, b):", "My favourite food is"]
    outputs = llm.beam_search(prompts, BeamSearchParams(beam_width=4, max_tokens=8))
    tokenizer = llm.get_tokenizer()
    for prompt, out in zip(prompts, outputs):
        ids = tokenizer.encode(prompt)
        assert len(out.sequences) == 4
        scores = [s.cum_logprob / len(s.tokens) for s in out.sequences]
        assert scores == sorted(scores, reverse=True)
        best = out.sequences[0]
        assert best.tokens[: len(ids)] == ids
        assert best.tokens[len(ids) :] == hf_beam_search(smollm2_hf, ids, 4, 8), prompt
    assert llm.llm_engine.get_stats().kv_cache_usage == 0.0
