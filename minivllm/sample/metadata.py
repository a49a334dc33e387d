"""Builds a step's SamplingMetadata from the sampling requests' parameters and tokens."""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from minivllm.sample.penalties import SeenTokens
from minivllm.sample.sampler import SamplingMetadata
from minivllm.sampling_params import SamplingParams


class SamplingState(Protocol):
    sampling_params: SamplingParams
    token_ids: list[int]  # prompt + output
    num_prompt_tokens: int
    output_ids: list[int]
    eos_token_id: int | None
    generator: torch.Generator | None
    seen_tokens: SeenTokens | None  # None until the request first samples with penalties


def build_sampling_metadata(states: list[SamplingState], vocab_size: int) -> SamplingMetadata:
    params = [s.sampling_params for s in states]
    greedy = [p.temperature < 1e-5 for p in params]
    use_top_k = any(p.top_k > 0 for p in params)
    meta = SamplingMetadata(
        # Greedy rows carry temperature 0, which is how the sampler tells them apart.
        temperature=torch.tensor(
            [0.0 if g else p.temperature for p, g in zip(params, greedy)], dtype=torch.float32
        ),
        all_greedy=all(greedy),
        # Greedy rows count as top-1, so a batch of top-k rows and greedy rows stays top-k.
        top_k=torch.tensor([1 if g else p.top_k for p, g in zip(params, greedy)])
        if use_top_k
        else None,
        top_p=torch.tensor([p.top_p for p in params]) if any(p.top_p < 1 for p in params) else None,
        min_p=torch.tensor([p.min_p for p in params]) if any(p.min_p > 0 for p in params) else None,
        generators={i: s.generator for i, s in enumerate(states) if s.generator is not None},
    )
    if any(_uses_penalties(p) for p in params):
        _add_penalties(meta, states)
    _add_bans_and_biases(meta, states, vocab_size)
    wanted = [p.logprobs for p in params if p.logprobs is not None]
    if wanted:
        meta.max_num_logprobs = vocab_size if -1 in wanted else max(wanted)
    return meta


def _uses_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or bool(p.presence_penalty) or bool(p.frequency_penalty)


def _seen_tokens(state: SamplingState) -> SeenTokens:
    # Built from the prompt at the request's first sampled step, then kept up to date.
    if state.seen_tokens is None:
        state.seen_tokens = SeenTokens(state.token_ids[: state.num_prompt_tokens])
    state.seen_tokens.update(state.output_ids)
    return state.seen_tokens


def _add_penalties(meta: SamplingMetadata, states: list[SamplingState]) -> None:
    params = [s.sampling_params for s in states]
    rows = [i for i, p in enumerate(params) if _uses_penalties(p)]
    seen = [_seen_tokens(states[i]) for i in rows]
    # Flattened (row, token, output count) triples of every penalized row's seen tokens.
    meta.penalty_rows = torch.from_numpy(np.repeat(rows, [len(t.token_ids) for t in seen]))
    meta.penalty_token_ids = torch.from_numpy(np.concatenate([t.token_ids for t in seen]))
    meta.penalty_output_counts = torch.from_numpy(np.concatenate([t.output_counts for t in seen]))
    meta.repetition_penalty = torch.tensor([p.repetition_penalty for p in params])
    meta.presence_penalty = torch.tensor([p.presence_penalty for p in params])
    meta.frequency_penalty = torch.tensor([p.frequency_penalty for p in params])


def _add_bans_and_biases(meta: SamplingMetadata, states: list[SamplingState], vocab: int) -> None:
    banned = []
    bias_rows, bias_ids, bias_values = [], [], []
    allowed_rows, allowed_masks = [], []
    for i, s in enumerate(states):
        p = s.sampling_params
        row_bans = []
        if len(s.output_ids) < p.min_tokens:
            row_bans += p.stop_token_ids
            if s.eos_token_id is not None and not p.ignore_eos:
                row_bans.append(s.eos_token_id)
        for word in getattr(p, "bad_words_token_ids", None) or ():
            # Ban a bad word's last token when the output already ends with the rest of it.
            prefix = word[:-1]
            if not prefix or s.output_ids[-len(prefix) :] == prefix:
                row_bans.append(word[-1])
        if row_bans:
            banned.append((i, row_bans))
        logit_bias = getattr(p, "logit_bias", None)
        if logit_bias:
            for token_id, bias in logit_bias.items():
                bias_rows.append(i)
                bias_ids.append(int(token_id))
                bias_values.append(float(bias))
        allowed = getattr(p, "allowed_token_ids", None)
        if allowed:
            mask = torch.zeros(vocab, dtype=torch.bool)
            mask[torch.tensor(allowed)] = True
            allowed_rows.append(i)
            allowed_masks.append(mask)
    meta.banned = banned or None
    if bias_rows:
        meta.logit_bias = (
            torch.tensor(bias_rows),
            torch.tensor(bias_ids),
            torch.tensor(bias_values, dtype=torch.float32),
        )
    if allowed_rows:
        meta.allowed_tokens = (torch.tensor(allowed_rows), torch.stack(allowed_masks))
