"""One request's token bans and biases, built once from its SamplingParams.

A step then costs each row work that does not grow with the request's lists: logit_bias
and allowed_token_ids are tensors made once (the step concatenates them); bad words are
indexed by the length of their prefix (every token but the last), so the words whose last
token the step bans are found by looking up the output's suffix of each such length, not
by comparing it with every word.
"""

from __future__ import annotations

import torch

from minivllm.sampling_params import SamplingParams


class RequestBans:
    def __init__(self, params: SamplingParams, vocab_size: int) -> None:
        bias = getattr(params, "logit_bias", None) or {}
        self.bias_ids = torch.tensor(list(bias), dtype=torch.long) if bias else None
        self.bias_values = torch.tensor(list(bias.values()), dtype=torch.float32) if bias else None
        allowed = getattr(params, "allowed_token_ids", None)
        self.allowed_mask = None
        if allowed:
            self.allowed_mask = torch.zeros(vocab_size, dtype=torch.bool)
            self.allowed_mask[torch.tensor(allowed, dtype=torch.long)] = True
        # Bad words: the one-token ones always banned; the others' last tokens by prefix.
        always: set[int] = set()
        by_prefix: dict[int, dict[tuple[int, ...], set[int]]] = {}
        for word in getattr(params, "bad_words_token_ids", None) or ():
            if len(word) == 1:
                always.add(word[0])
            elif word:
                by_prefix.setdefault(len(word) - 1, {}).setdefault(tuple(word[:-1]), set())
                by_prefix[len(word) - 1][tuple(word[:-1])].add(word[-1])
        self.always_banned = sorted(always)
        self._by_prefix = sorted(by_prefix.items())

    def bad_word_ends(self, output_ids: list[int]) -> list[int]:
        """The last tokens of the bad words whose other tokens the output ends with."""
        banned = list(self.always_banned)
        for length, prefixes in self._by_prefix:
            if length > len(output_ids):
                break
            ends = prefixes.get(tuple(output_ids[-length:]))
            if ends:
                banned.extend(ends)
        return banned
