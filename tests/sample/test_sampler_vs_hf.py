"""Each processor against HF transformers' own logits processor on random logits."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from transformers.generation import logits_process as hf

from minivllm.sample.metadata import build_sampling_metadata
from minivllm.sample.penalties import SeenTokens
from minivllm.sample.sampler import (
    apply_bans_and_biases,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
)
from minivllm.sampling_params import SamplingParams

VOCAB = 64


def logits_row(seed: int) -> torch.Tensor:
    return torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


@dataclass
class State:
    sampling_params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int
    output_ids: list[int] = field(default_factory=list)
    eos_token_id: int | None = None
    generator: torch.Generator | None = None
    seen_tokens: SeenTokens | None = None


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("k", [1, 5, 20])
def test_top_k(seed, k):
    logits = logits_row(seed)
    expected = hf.TopKLogitsWarper(k)(None, logits.clone())
    ours = apply_top_k_top_p(logits.clone(), torch.tensor([k]), None)
    assert torch.equal(torch.isfinite(ours), torch.isfinite(expected))


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("p", [0.3, 0.7, 0.95])
def test_top_p(seed, p):
    logits = logits_row(seed)
    expected = hf.TopPLogitsWarper(p)(None, logits.clone())
    ours = apply_top_k_top_p(logits.clone(), None, torch.tensor([p]))
    assert torch.equal(torch.isfinite(ours), torch.isfinite(expected))


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("min_p", [0.05, 0.3])
def test_min_p(seed, min_p):
    logits = logits_row(seed)
    expected = hf.MinPLogitsWarper(min_p)(None, logits.clone())
    ours = apply_min_p(logits.softmax(-1), torch.tensor([min_p]))
    assert torch.equal(ours > 0, torch.isfinite(expected))


@pytest.mark.parametrize("penalty", [0.8, 1.3])
def test_repetition_penalty(penalty):
    logits = logits_row(0)
    prompt, output = [1, 5, 9, 5], [9, 30, 31]
    expected = hf.RepetitionPenaltyLogitsProcessor(penalty)(
        torch.tensor([prompt + output]), logits.clone()
    )
    state = State(SamplingParams(repetition_penalty=penalty), prompt + output, 4, output)
    meta = build_sampling_metadata([state], VOCAB)
    torch.testing.assert_close(apply_penalties(logits.clone(), meta), expected)


def test_presence_and_frequency_penalties_follow_openai_formula():
    logits = logits_row(1)
    prompt, output = [2, 3], [7, 7, 7, 8]
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    meta = build_sampling_metadata([State(params, prompt + output, 2, output)], VOCAB)
    expected = logits.clone()
    for token, count in ((7, 3), (8, 1)):  # OpenAI: - count * freq - (count > 0) * presence
        expected[0, token] -= count * 0.25 + 0.5
    torch.testing.assert_close(apply_penalties(logits.clone(), meta), expected)


def test_bad_words_match_no_bad_words_processor():
    logits = logits_row(2)
    bad = [[11], [20, 21], [5, 6, 7]]
    output = [3, 20]  # ends with the start of [20, 21], not of [5, 6, 7]
    expected = hf.NoBadWordsLogitsProcessor(bad, eos_token_id=0)(
        torch.tensor([[1] + output]), logits.clone()
    )
    params = SamplingParams()
    params.bad_words_token_ids = bad
    meta = build_sampling_metadata([State(params, [1] + output, 1, output)], VOCAB)
    ours = apply_bans_and_biases(logits.clone(), meta)
    assert torch.equal(torch.isfinite(ours), torch.isfinite(expected))


def test_logit_bias_matches_sequence_bias_processor():
    logits = logits_row(3)
    bias = {4: 3.5, 10: -2.0}
    expected = hf.SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})(
        torch.tensor([[1, 2]]), logits.clone()
    )
    meta = build_sampling_metadata([State(SamplingParams(logit_bias=bias), [1, 2], 2)], VOCAB)
    torch.testing.assert_close(apply_bans_and_biases(logits.clone(), meta), expected)
