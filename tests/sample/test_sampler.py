"""The sampler's processors against independent references on random logits."""

from __future__ import annotations

import torch

from minivllm.sample.sampler import (
    Sampler,
    SamplingMetadata,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    random_sample,
)

VOCAB = 50


def random_logits(batch=4, seed=0):
    return torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def meta(batch, **kwargs):
    fields = dict(
        temperature=torch.ones(batch),
        all_greedy=False,
        top_k=None,
        top_p=None,
        min_p=None,
        generators={},
    )
    fields.update(kwargs)
    return SamplingMetadata(**fields)


def test_top_k_keeps_exactly_the_k_largest():
    logits = random_logits()
    k = torch.tensor([1, 3, 0, VOCAB])
    out = apply_top_k_top_p(logits, k, None)
    for row, kk in enumerate([1, 3, VOCAB, VOCAB]):
        kept = torch.isfinite(out[row]).nonzero().flatten().tolist()
        assert sorted(kept) == sorted(logits[row].topk(kk).indices.tolist())
        assert torch.equal(out[row][kept], logits[row][kept])


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = random_logits()
    top_p = torch.tensor([0.1, 0.5, 0.9, 1.0])
    out = apply_top_k_top_p(logits, None, top_p)
    for row in range(4):
        probs = logits[row].softmax(-1)
        order = probs.argsort(descending=True)
        cum = probs[order].cumsum(0)
        n_keep = int((cum < top_p[row]).sum()) + 1  # reference: first index reaching p
        expected = set(order[: min(n_keep, VOCAB)].tolist())
        assert set(torch.isfinite(out[row]).nonzero().flatten().tolist()) == expected


def test_min_p_drops_tokens_below_fraction_of_max():
    probs = random_logits().softmax(-1)
    min_p = torch.tensor([0.0, 0.1, 0.5, 1.0])
    out = apply_min_p(probs, min_p)
    for row in range(4):
        keep = probs[row] >= probs[row].max() * min_p[row]
        assert torch.equal(out[row] > 0, keep)


def test_penalties_follow_the_formulas():
    logits = random_logits(batch=2)
    # Row 0 saw token 3 twice in its output and token 5 in its prompt; row 1 token 4 once.
    m = meta(
        2,
        repetition_penalty=torch.tensor([1.5, 1.0]),
        frequency_penalty=torch.tensor([0.0, 0.5]),
        presence_penalty=torch.tensor([0.0, 0.25]),
        penalty_rows=torch.tensor([0, 0, 1]),
        penalty_token_ids=torch.tensor([3, 5, 4]),
        penalty_output_counts=torch.tensor([2.0, 0.0, 1.0]),
    )
    out = apply_penalties(logits.clone(), m)
    expected = logits.clone()
    for tok in (3, 5):  # repetition: prompt and output tokens, divided if positive
        x = logits[0, tok]
        expected[0, tok] = x / 1.5 if x > 0 else x * 1.5
    expected[1, 4] = logits[1, 4] - 0.5 * 1 - 0.25
    torch.testing.assert_close(out, expected)


def test_seeded_rows_ignore_the_rest_of_the_batch():
    logits = random_logits(batch=3)
    sampler = Sampler()

    def draw(batch_logits, row):
        m = meta(
            batch_logits.shape[0],
            temperature=torch.full((batch_logits.shape[0],), 0.8),
            generators={row: torch.Generator().manual_seed(7)},
        )
        return sampler(batch_logits.clone(), m).sampled_token_ids[row].item()

    alone = [draw(logits[1:2], 0) for _ in range(3)]
    in_batch = [draw(logits, 1) for _ in range(3)]
    assert alone == in_batch


def test_greedy_rows_in_a_mixed_batch_take_the_argmax():
    logits = random_logits()
    m = meta(4, temperature=torch.tensor([0.0, 1.0, 0.0, 1.0]))
    out = Sampler()(logits.clone(), m).sampled_token_ids
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(3)
    for _ in range(2000):
        m = meta(1, generators={0: gen})
        counts[Sampler()(logits.clone(), m).sampled_token_ids[0]] += 1
    torch.testing.assert_close(counts / 2000, torch.tensor([0.7, 0.2, 0.1]), atol=0.04, rtol=0)


def test_random_sample_never_draws_a_token_of_probability_zero():
    # Zero mass at both ends and in the middle of the vocabulary, many rows at once.
    probs = torch.tensor([0.0, 0.5, 0.0, 0.5, 0.0]).repeat(4096, 1)
    drawn = random_sample(probs, generators={})
    assert set(drawn.tolist()) == {1, 3}
    assert abs((drawn == 1).float().mean().item() - 0.5) < 0.04


def test_logit_bias_allowed_tokens_and_bans():
    logits = random_logits(batch=3)
    m = meta(
        3,
        temperature=torch.zeros(3),
        all_greedy=True,
        logit_bias=(torch.tensor([0]), torch.tensor([7]), torch.tensor([100.0])),
        allowed_tokens=(
            torch.tensor([1]),
            torch.zeros(1, VOCAB, dtype=torch.bool).index_fill_(1, torch.tensor([11, 12]), True),
        ),
        banned=[(2, [int(logits[2].argmax())])],
    )
    out = Sampler()(logits.clone(), m).sampled_token_ids
    assert out[0] == 7
    assert out[1] == (11 if logits[1, 11] > logits[1, 12] else 12)
    assert out[2] == logits[2].topk(2).indices[1]


def test_top_k_fast_path_samples_only_within_top_k():
    logits = random_logits(batch=4, seed=3)
    k = torch.tensor([2, 5, 1, 3])
    for seed in range(20):
        m = meta(
            4,
            top_k=k,
            top_p=torch.full((4,), 0.9),
            generators={i: torch.Generator().manual_seed(seed * 4 + i) for i in range(4)},
        )
        out = Sampler()(logits.clone(), m).sampled_token_ids
        for row in range(4):
            assert out[row] in logits[row].topk(int(k[row])).indices


def test_logprobs_and_ranks_of_the_raw_distribution():
    logits = random_logits(batch=2)
    m = meta(2, temperature=torch.zeros(2), all_greedy=True, max_num_logprobs=3)
    m.banned = [(1, [int(logits[1].argmax())])]  # row 1 samples its second-best token
    out = Sampler()(logits.clone(), m)
    reference = torch.log_softmax(logits, dim=-1)
    top = reference.topk(3)
    for row, rank in ((0, 1), (1, 2)):
        sampled = int(out.sampled_token_ids[row])
        assert out.logprob_token_ids[row, 0] == sampled
        assert out.logprob_token_ids[row, 1:].tolist() == top.indices[row].tolist()
        torch.testing.assert_close(out.logprobs[row, 0], reference[row, sampled])
        torch.testing.assert_close(out.logprobs[row, 1:], top.values[row])
        assert out.sampled_ranks[row] == rank
