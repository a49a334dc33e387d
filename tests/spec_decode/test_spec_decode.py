"""Speculative decoding with n-gram proposals on the bundled model: greedy outputs are the
engine's without it, token for token, whatever else the batch holds (penalized seeded
sampling, logprobs, a stop token inside an accepted run), with chunked prefill, prefix
caching and preemption; proposals are accepted, and their steps replay CPU graphs. Tiny
checkpoints of other architectures, with a proposer that knows the answer; at a
temperature, each position's distribution as without proposals.

No expectation here is a trajectory seen on one CPU: the int8 kernels round differently on
another instruction set (AVX-512 VNNI, AVX2, plain C), and the quantized model's greedy
reply with them. Each test compares with the plain engine's run on this machine, and what
it expects of the proposals (how many are accepted, where a stop falls inside an accepted
run) is computed from that run: the n-gram proposer is a pure function of the tokens so
far, so a greedy request's proposals are those it makes along the plain trajectory.
Replies are forced to their full length (``ignore_eos``) so sizes do not depend on it."""

from __future__ import annotations

import numpy as np
import pytest

from minivllm import LLM, SamplingParams
from minivllm.config import SpeculativeConfig
from minivllm.spec_decode.ngram_proposer import NgramProposer

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}
ENGINE = dict(enable_multiprocessing=False, max_model_len=1024, kv_cache_memory_bytes=1 << 26)
CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
MESSAGES = [
    [{"role": "user", "content": "Repeat this code exactly:\n\n" + CODE}],
    [{"role": "user", "content": "Count from 1 to 30, separated by commas."}],
    [{"role": "user", "content": "Write one sentence about the sea."}],
]
# 64 tokens hold the copied code and its accepted runs; each token is a step of the bundled
# model, which under plain C (make test-isa) costs most of this file.
MAX_TOKENS = 64
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def prompts(llm: LLM) -> list[str]:
    tokenizer = llm.get_tokenizer()
    return [
        tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False)
        for m in MESSAGES
    ]


def scheduler(llm: LLM):
    return llm.llm_engine.engine_core.engine_core.scheduler


def proposal_replay(prompt: list[int], output: list[int], max_tokens: int) -> tuple[int, set]:
    """The proposals a greedy request with this plain output gets, replayed with the same
    proposer: how many are accepted, and the output positions that are accepted proposals
    (a proposal is proposed after each sampling step and accepted up to its first token the
    model disagrees with; nothing here cuts it but max_tokens)."""
    config = SpeculativeConfig.parse(SPEC)
    proposer = NgramProposer(
        config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
    )
    accepted, positions, n = 0, set(), 1  # the first token comes from the prompt's step
    while n < len(output):
        tokens = np.array(prompt + output[:n], dtype=np.int64)
        proposal = proposer.propose(tokens, max_tokens - n - 1)
        run = 0
        while run < len(proposal) and n + run < len(output) and proposal[run] == output[n + run]:
            run += 1
        accepted += run
        positions.update(range(n, n + run))
        n += run + 1
    return accepted, positions


@pytest.fixture(scope="module")
def plain(smollm2_path):
    llm = LLM(smollm2_path, **ENGINE)
    yield llm
    llm.llm_engine.shutdown()


@pytest.fixture(scope="module")
def spec(smollm2_path):
    llm = LLM(smollm2_path, speculative_config=SPEC, **ENGINE)
    yield llm
    llm.llm_engine.shutdown()


def outputs(llm: LLM, batch: list[str], params) -> list:
    return [o.outputs[0] for o in llm.generate(batch, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def trajectories(plain) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy output ids) of each prompt, as the plain engine computes them on
    this machine."""
    done = plain.generate(prompts(plain), GREEDY, use_tqdm=False)
    return [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in done]


def test_the_proposer_replay_is_the_lookup():
    """The replay the tests below expect from: on a reply that copies its prompt, the
    tokens after the first copied pair are proposed 4 at a time, each run followed by the
    model's own token, the last run cut by max_tokens; a reply that never repeats: none."""
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    accepted, positions = proposal_replay(prompt, [1, 2, 3, 4, 5, 6, 7, 8, 9, 1], 10)
    assert (accepted, positions) == (6, {2, 3, 4, 5, 7, 8})
    assert proposal_replay(prompt, [20, 21, 22, 23], 10) == (0, set())


def test_greedy_outputs_equal_the_engine_without_proposals(plain, spec, trajectories):
    batch = prompts(plain)
    expected = [out for _, out in trajectories]
    before = scheduler(spec).make_stats()
    # One at a time (one-token rows, CPU graphs replayed), then all together.
    assert [outputs(spec, [p], GREEDY)[0].token_ids for p in batch] == expected
    assert [o.token_ids for o in outputs(spec, batch, GREEDY)] == expected
    stats = scheduler(spec).make_stats()
    accepted = stats.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    drafted = stats.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    # Every proposal the plain trajectory allows is made and accepted, in both runs.
    replayed = sum(proposal_replay(p, out, MAX_TOKENS)[0] for p, out in trajectories)
    assert replayed > 0  # the copied code repeats its prompt's n-grams
    assert accepted == 2 * replayed and drafted >= accepted
    # The steps of one request and its four proposals replayed a graph of five rows.
    runner = spec.llm_engine.engine_core.engine_core.executor.worker.model_runner
    assert runner.cpu_graphs.get(5) is not None


def test_other_requests_in_the_batch_are_unchanged(plain, spec):
    """A seeded random request with a penalty and one with logprobs get no proposals;
    their outputs, and the greedy ones beside them, are the engine's without proposals."""
    batch = prompts(plain)
    params = [
        GREEDY,
        SamplingParams(temperature=0.8, seed=7, max_tokens=32, repetition_penalty=1.1),
        SamplingParams(temperature=0, max_tokens=32, logprobs=2),
    ]
    expected, got = outputs(plain, batch, params), outputs(spec, batch, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    for a, b in zip(got[2].logprobs, expected[2].logprobs):
        assert a.keys() == b.keys()
        assert all(a[t].logprob == pytest.approx(b[t].logprob, abs=1e-5) for t in a)


def test_a_stop_token_inside_an_accepted_run_ends_the_output_there(plain, spec, trajectories):
    batch = prompts(plain)[:1]
    prompt, full = trajectories[0]
    _, inside = proposal_replay(prompt, full, MAX_TOKENS)
    # A stop token first seen at an accepted proposal followed by another: proposals run
    # across it, and the output must end there all the same.
    stop_at = next(i for i in sorted(inside) if i + 1 in inside and full[i] not in full[:i])
    params = SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, stop_token_ids=[full[stop_at]]
    )
    expected = outputs(plain, batch, params)[0]
    got = outputs(spec, batch, params)[0]
    assert got.token_ids == expected.token_ids == full[: stop_at + 1]
    assert got.finish_reason == expected.finish_reason == "stop"
    # A stop string inside an accepted run: the text ends before it, as without proposals.
    tokenizer = plain.get_tokenizer()
    stop = next(
        text
        for i in sorted(inside)
        if i + 2 in inside and (text := tokenizer.decode(full[i : i + 2]).strip())
    )
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, stop=[stop])
    expected, got = outputs(plain, batch, params)[0], outputs(spec, batch, params)[0]
    assert expected.stop_reason == stop
    assert (got.text, got.token_ids, got.stop_reason) == (
        expected.text,
        expected.token_ids,
        expected.stop_reason,
    )
    # max_tokens inside an accepted run: exactly that many tokens.
    cut = next(i for i in sorted(inside) if i + 1 in inside) + 1
    params = SamplingParams(temperature=0, max_tokens=cut, ignore_eos=True)
    assert outputs(spec, batch, params)[0].token_ids == full[:cut]


def test_chunked_prefill_prefix_caching_and_preemption(plain, smollm2_path, trajectories):
    batch = prompts(plain)
    expected = [out for _, out in trajectories]
    # Small steps (prompts in chunks, proposals cut to the budget) and a cache of 11 blocks
    # (720 KiB each) of 16 tokens: the replies are forced to their full length, so the
    # requests need more blocks than that together, whatever they say. They are preempted
    # and recomputed, their prompts found again in the prefix cache.
    lengths = [len(p) + len(out) for p, out in trajectories]
    assert sum(-(-n // 16) for n in lengths) > 11 and max(lengths) <= 176
    llm = LLM(
        smollm2_path,
        speculative_config=SPEC,
        enable_multiprocessing=False,
        max_model_len=176,
        max_num_batched_tokens=24,
        kv_cache_memory_bytes=11 * 720 * 1024,
    )
    try:
        assert [o.token_ids for o in outputs(llm, batch, GREEDY)] == expected
        stats = scheduler(llm).make_stats()
        assert stats.num_preemptions > 0 and stats.spec_decode_num_accepted_tokens > 0
        assert stats.prefix_cache_hits > 0
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(async_scheduling=True), "do not combine"),
        (dict(runner="pooling"), "needs a generative model"),
    ],
)
def test_combinations_not_served_are_refused(smollm2_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(smollm2_path, speculative_config=SPEC, enable_multiprocessing=False, **kwargs)


@pytest.mark.parametrize("arch", ["qwen3", "gemma3", "gemma4", "gpt-oss"])
def test_tiny_architectures_give_the_same_greedy_tokens(
    arch, tmp_path, smollm2_tokenizer, monkeypatch
):
    """Sliding windows and soft-capping (Gemma 3), layers that read earlier layers' K/V
    with the fast prefill on (Gemma 4), sinks and experts (gpt-oss), in steps of decode rows
    and in steps mixed with a prompt's chunks (a small token budget). Random weights seldom
    repeat themselves, so the proposer here knows the answer: it proposes the plain engine's
    next tokens, the last of them wrong every other time."""
    from tests.conftest import write_tiny_checkpoint
    from tests.spec_decode import oracle

    folder = write_tiny_checkpoint(arch, str(tmp_path / arch), smollm2_tokenizer)
    batch = [
        {"prompt_token_ids": [5, 6, 7, 8, 9] * 6},
        {"prompt_token_ids": list(range(300, 360))},
        {"prompt_token_ids": [11, 12] * 20},
    ]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine = dict(
        enable_multiprocessing=False,
        max_model_len=256,
        max_num_batched_tokens=32,
        kv_cache_memory_bytes=1 << 24,
        kv_sharing_fast_prefill=arch == "gemma4",
    )
    llm = LLM(folder, **engine)
    try:
        expected = [o.outputs[0].token_ids for o in llm.generate(batch, params)]
    finally:
        llm.llm_engine.shutdown()
    full = [p["prompt_token_ids"] + out for p, out in zip(batch, expected)]
    oracle.install(monkeypatch, full)
    llm = LLM(folder, speculative_config={"num_speculative_tokens": 3}, **engine)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(batch, params)] == expected
        stats = scheduler(llm).make_stats()
    finally:
        llm.llm_engine.shutdown()
    rejected = stats.spec_decode_num_draft_tokens - stats.spec_decode_num_accepted_tokens
    assert stats.spec_decode_num_accepted_tokens > 30 and rejected > 5


def test_random_sampling_keeps_the_models_distribution(tmp_path, smollm2_tokenizer, monkeypatch):
    """At a temperature a proposal is kept when the row's own draw equals it: each
    position's tokens follow the model's distribution as without proposals. Over 1,200
    seeded requests (4 allowed tokens, so the distribution is spread), a proposer that
    always proposes the same token must not pull the positions after the first towards it."""
    from minivllm.spec_decode import ngram_proposer
    from tests.conftest import write_tiny_checkpoint

    folder = write_tiny_checkpoint("qwen3", str(tmp_path / "qwen3"), smollm2_tokenizer)
    allowed = [300, 301, 302, 303]
    batch = [{"prompt_token_ids": [5, 6, 7, 8, 9]}] * 1200
    params = [
        SamplingParams(temperature=3.0, seed=i, max_tokens=4, allowed_token_ids=allowed)
        for i in range(1200)
    ]
    engine = dict(enable_multiprocessing=False, max_model_len=64, kv_cache_memory_bytes=1 << 26)

    def marginals(llm) -> list[list[float]]:
        outs = [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
        return [[sum(o[i] == t for o in outs) / len(outs) for t in allowed] for i in range(4)]

    llm = LLM(folder, **engine)
    try:
        expected = marginals(llm)
    finally:
        llm.llm_engine.shutdown()
    assert all(max(p) < 0.8 for p in expected)  # spread: the check below means something
    monkeypatch.setattr(
        ngram_proposer.NgramProposer,
        "propose",
        lambda self, tokens, max_tokens=None: [allowed[0]] * min(3, max_tokens or 3),
    )
    llm = LLM(folder, speculative_config={"num_speculative_tokens": 3}, **engine)
    try:
        got = marginals(llm)
        stats = scheduler(llm).make_stats()
    finally:
        llm.llm_engine.shutdown()
    assert got[0] == expected[0]  # sampled after the prompt, before any proposal
    for position in (1, 2, 3):
        distance = sum(abs(a - b) for a, b in zip(got[position], expected[position])) / 2
        # ~0.02 expected from sampling alone; keeping every draw, even after a
        # rejected proposal, gave 0.13 at 600 requests.
        assert distance < 0.07, (position, got[position], expected[position])
    accepted = stats.spec_decode_num_accepted_tokens
    assert 0 < accepted < stats.spec_decode_num_draft_tokens
