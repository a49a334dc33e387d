import random
from collections import Counter

import numpy as np
import pytest
import torch

from minivllm.sample.metadata import build_sampling_metadata
from minivllm.sample.penalties import SeenTokens
from minivllm.sample.sampler import apply_penalties
from minivllm.sampling_params import SamplingParams
from tests.sample.test_sampler_vs_hf import State


def test_seen_tokens_counts_outputs_and_lists_each_token_once():
    seen = SeenTokens([5, 3, 5, 9])
    output: list[int] = []
    for token in [9, 7, 7, 3, 11]:
        output.append(token)
        seen.update(output)
    counts = dict(zip(seen.token_ids.tolist(), seen.output_counts.tolist()))
    assert counts == {3: 1.0, 5: 0.0, 9: 1.0, 7: 2.0, 11: 1.0}


@pytest.mark.parametrize("steps_per_update", [1, 3])
def test_seen_tokens_grows_past_its_capacity(steps_per_update):
    rng = random.Random(0)
    prompt = [rng.randrange(1000) for _ in range(40)]
    seen = SeenTokens(prompt)
    output: list[int] = []
    for step in range(600):  # far more distinct tokens than the first capacity of 80
        output.append(rng.randrange(1000))
        if step % steps_per_update == 0:
            seen.update(output)
    seen.update(output)
    ids = seen.token_ids.tolist()
    assert len(ids) == len(set(ids)) == len(set(prompt) | set(output))
    expected = Counter(output)
    assert seen.output_counts.tolist() == [float(expected[t]) for t in ids]


def test_sparse_penalties_equal_dense_formulas_on_a_batch():
    vocab, rng = 50, random.Random(1)
    params = [
        SamplingParams(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2),
        SamplingParams(),  # no penalties in the same batch: untouched
        SamplingParams(repetition_penalty=0.7),
    ]
    states = []
    for p in params:
        prompt = [rng.randrange(vocab) for _ in range(6)]
        states.append(State(p, list(prompt), len(prompt), []))
    logits = torch.randn(len(states), vocab, generator=torch.Generator().manual_seed(2))
    for _ in range(5):  # several steps: the seen sets are updated, not rebuilt
        for s in states:
            token = rng.randrange(vocab)
            s.token_ids.append(token)
            s.output_ids.append(token)
        ours = apply_penalties(logits.clone(), build_sampling_metadata(states, vocab))
        expected = logits.clone()
        for row, (s, p) in enumerate(zip(states, params)):
            counts = np.bincount(s.output_ids, minlength=vocab)
            for token in set(s.token_ids):
                x = expected[row, token]
                x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
                x = x - p.frequency_penalty * counts[token]
                expected[row, token] = x - p.presence_penalty * (counts[token] > 0)
        torch.testing.assert_close(ours, expected)
