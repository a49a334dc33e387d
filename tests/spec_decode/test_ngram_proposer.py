"""Prompt lookup: what follows the latest earlier occurrence of the longest suffix n-gram."""

from __future__ import annotations

import numpy as np
import pytest

from minivllm.config import SpeculativeConfig
from minivllm.spec_decode.ngram_proposer import NgramProposer


def propose(tokens, k=3, min_n=2, max_n=4, max_tokens=None):
    return NgramProposer(k, min_n, max_n).propose(np.array(tokens, dtype=np.int32), max_tokens)


def test_proposes_what_followed_the_suffix():
    assert propose([1, 2, 3, 4, 5, 9, 1, 2, 3]) == [4, 5, 9]
    # The latest earlier occurrence wins.
    assert propose([1, 2, 3, 4, 1, 2, 3, 7, 1, 2, 3]) == [7, 1, 2]
    # Fewer than k tokens when the occurrence is near the end.
    assert propose([5, 1, 2, 8, 1, 2]) == [8, 1, 2]
    assert propose([7, 7, 7]) == [7]


def test_the_longest_suffix_that_occurs_decides():
    # [3, 1, 2] (n=3) occurs once, followed by 5; [1, 2] (n=2) occurs later, followed by 6.
    assert propose([3, 1, 2, 5, 1, 2, 6, 3, 1, 2], k=1) == [5]
    assert propose([3, 1, 2, 5, 1, 2, 6, 3, 1, 2], k=1, max_n=2) == [6]


def test_nothing_when_no_suffix_of_min_n_repeats():
    assert propose([1, 2, 3, 4, 5]) == []
    assert propose([1, 2, 9, 2], min_n=2) == []  # only the last token (n=1) repeats
    assert propose([1, 2, 9, 2], min_n=1) == [9, 2]
    assert propose([4]) == []


def test_max_tokens_caps_the_proposal():
    assert propose([1, 2, 3, 4, 5, 1, 2], k=4, max_tokens=2) == [3, 4]
    assert propose([1, 2, 3, 4, 5, 1, 2], k=4, max_tokens=0) == []


def test_speculative_config_parses_vllm_forms():
    parse = SpeculativeConfig.parse
    assert parse(None) is None
    config = parse('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}')
    assert (config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max) == (
        4,
        3,
        3,
    )
    config = parse({"num_speculative_tokens": 2})
    assert (config.method, config.prompt_lookup_min, config.prompt_lookup_max) == ("ngram", 5, 5)
    config = parse({"num_speculative_tokens": 2, "prompt_lookup_min": 2, "prompt_lookup_max": 6})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (2, 6)


@pytest.mark.parametrize(
    "value, message",
    [
        ("{", "not valid JSON"),
        ("[1]", "JSON object"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "draft models are not served"),
        ({"method": "ngram"}, "needs num_speculative_tokens"),
        ({"num_speculative_tokens": 0}, "positive integer"),
        ({"num_speculative_tokens": "3"}, "positive integer"),
        ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "at most"),
        ({"num_speculative_tokens": 2, "model": "x"}, "Unknown speculative_config field"),
    ],
)
def test_bad_speculative_configs_are_refused(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(value)
