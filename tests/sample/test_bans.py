"""A request's bans and biases, built once: bad words found by their prefix index as by a
comparison with every word; logit_bias and allowed_token_ids as tensors that a step only
concatenates, kept with the request between steps."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import torch

from minivllm.sample.bans import RequestBans
from minivllm.sample.metadata import build_sampling_metadata
from minivllm.sample.sampler import apply_bans_and_biases
from minivllm.sampling_params import SamplingParams


def every_word(words: list[list[int]], output: list[int]) -> set[int]:
    return {w[-1] for w in words if not w[:-1] or output[-len(w[:-1]) :] == w[:-1]}


def test_bad_words_by_prefix_equal_a_pass_over_every_word():
    rng = random.Random(0)
    for _ in range(500):
        words = [[rng.randint(0, 4) for _ in range(rng.randint(1, 4))] for _ in range(8)]
        params = SamplingParams()
        params.bad_words_token_ids = words
        bans = RequestBans(params, 8)
        output = [rng.randint(0, 4) for _ in range(rng.randint(0, 6))]
        assert set(bans.bad_word_ends(output)) == every_word(words, output)


@dataclass
class State:
    sampling_params: SamplingParams
    output_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0
    eos_token_id: int | None = 2
    generator: None = None
    seen_tokens: None = None
    bans: RequestBans | None = None


def test_a_step_applies_the_prebuilt_tensors():
    vocab = 10
    biased = SamplingParams(logit_bias={3: 50.0, 5: -100.0})
    allowed = SamplingParams(allowed_token_ids=[1, 4])
    worded = SamplingParams(min_tokens=3)
    worded.bad_words_token_ids = [[6], [7, 8]]
    states = [State(biased, []), State(allowed, []), State(worded, [7])]
    arrays_meta = build_sampling_metadata(states, vocab)
    bans = [s.bans for s in states]
    assert all(b is not None for b in bans)
    logits = apply_bans_and_biases(torch.zeros(3, vocab), arrays_meta)
    assert logits[0, 3] == 50.0 and logits[0, 5] == -100.0 and logits[0, 0] == 0.0
    assert torch.isinf(logits[1]).tolist() == [i not in (1, 4) for i in range(vocab)]
    # min_tokens bans EOS (2); bad words ban 6 always and 8 after 7.
    assert np.flatnonzero(torch.isinf(logits[2]).numpy()).tolist() == [2, 6, 8]
    # The next step reuses each request's tensors.
    states[2].output_ids = [7, 1, 1]
    meta = build_sampling_metadata(states, vocab)
    assert all(s.bans is b for s, b in zip(states, bans))
    logits = apply_bans_and_biases(torch.zeros(3, vocab), meta)
    assert np.flatnonzero(torch.isinf(logits[2]).numpy()).tolist() == [6]
