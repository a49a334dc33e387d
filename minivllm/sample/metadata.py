"""Builds a step's SamplingMetadata from the sampling requests' parameters and tokens."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Protocol

import numpy as np
import torch

from minivllm.sample.bans import RequestBans
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
    bans: RequestBans | None  # None until the request first samples with bans or biases


NO_LOGPROBS = -2  # num_logprobs of a row that asks for none (-1 asks for the vocabulary)


@dataclass
class SamplingArrays:
    """Sampling parameters as per-row arrays (one row per request).

    The InputBatch keeps one row per request, set once; a step gathers the rows that
    sample, so the per-step work is a few vectorized gathers, not a pass over each
    request's SamplingParams. The ``uses_*`` flags are taken from the Python values, so a
    parameter counts as set exactly when it did in the SamplingParams.
    """

    temperature: np.ndarray  # float32; 0 marks greedy rows
    top_k: np.ndarray  # int64, 0 = off
    top_p: np.ndarray  # float32
    min_p: np.ndarray  # float32
    repetition_penalty: np.ndarray  # float32
    presence_penalty: np.ndarray  # float32
    frequency_penalty: np.ndarray  # float32
    num_logprobs: np.ndarray  # int32; NO_LOGPROBS, -1 (the vocabulary) or k
    uses_top_k: np.ndarray  # bool
    uses_top_p: np.ndarray  # bool
    uses_min_p: np.ndarray  # bool
    uses_penalties: np.ndarray  # bool
    seeded: np.ndarray  # bool: the request draws from its own generator
    # min_tokens, bad words, logit bias or allowed tokens: handled row by row.
    has_bans_or_biases: np.ndarray  # bool

    @classmethod
    def empty(cls, num_rows: int) -> SamplingArrays:
        types = {"top_k": np.int64, "num_logprobs": np.int32}
        arrays = {}
        for f in fields(cls):
            dtype = (
                np.bool_
                if f.name.startswith(("uses_", "has_")) or f.name == "seeded"
                else (types.get(f.name, np.float32))
            )
            arrays[f.name] = np.zeros(num_rows, dtype=dtype)
        return cls(**arrays)

    @classmethod
    def from_params(cls, params: list[SamplingParams]) -> SamplingArrays:
        arrays = cls.empty(len(params))
        for row, p in enumerate(params):
            arrays.set_row(row, p)
        return arrays

    def set_row(self, row: int, p: SamplingParams) -> None:
        greedy = p.temperature < 1e-5
        # Greedy rows carry temperature 0, which is how the sampler tells them apart.
        self.temperature[row] = 0.0 if greedy else p.temperature
        self.top_k[row] = p.top_k
        self.top_p[row] = p.top_p
        self.min_p[row] = p.min_p
        self.repetition_penalty[row] = p.repetition_penalty
        self.presence_penalty[row] = p.presence_penalty
        self.frequency_penalty[row] = p.frequency_penalty
        self.num_logprobs[row] = NO_LOGPROBS if p.logprobs is None else p.logprobs
        self.uses_top_k[row] = p.top_k > 0
        self.uses_top_p[row] = p.top_p < 1
        self.uses_min_p[row] = p.min_p > 0
        self.uses_penalties[row] = p.uses_penalties
        self.seeded[row] = p.seed is not None
        self.has_bans_or_biases[row] = bool(
            p.min_tokens > 0
            or getattr(p, "bad_words_token_ids", None)
            or getattr(p, "logit_bias", None)
            or getattr(p, "allowed_token_ids", None)
        )

    def move_row(self, src: int, dst: int) -> None:
        for f in fields(self):
            array = getattr(self, f.name)
            array[dst] = array[src]

    def gather(self, rows: np.ndarray) -> SamplingArrays:
        """The rows, in this order (copies)."""
        return SamplingArrays(**{f.name: getattr(self, f.name)[rows] for f in fields(self)})


def build_sampling_metadata(
    states: list[SamplingState], vocab_size: int, arrays: SamplingArrays | None = None
) -> SamplingMetadata:
    """The step's SamplingMetadata; ``arrays`` holds the states' parameters row for row
    (built from their SamplingParams when not given)."""
    if arrays is None:
        arrays = SamplingArrays.from_params([s.sampling_params for s in states])
    greedy = arrays.temperature == 0
    meta = SamplingMetadata(
        temperature=torch.from_numpy(arrays.temperature),
        all_greedy=bool(greedy.all()),
        # Greedy rows count as top-1, so a batch of top-k rows and greedy rows stays top-k.
        top_k=torch.from_numpy(np.where(greedy, 1, arrays.top_k))
        if arrays.uses_top_k.any()
        else None,
        top_p=torch.from_numpy(arrays.top_p) if arrays.uses_top_p.any() else None,
        min_p=torch.from_numpy(arrays.min_p) if arrays.uses_min_p.any() else None,
        generators={
            i: states[i].generator
            for i in np.flatnonzero(arrays.seeded).tolist()
            if states[i].generator is not None
        },
    )
    if arrays.uses_penalties.any():
        _add_penalties(meta, states, arrays)
    if arrays.has_bans_or_biases.any():
        _add_bans_and_biases(meta, states, np.flatnonzero(arrays.has_bans_or_biases), vocab_size)
    wanted = arrays.num_logprobs[arrays.num_logprobs != NO_LOGPROBS]
    if wanted.size:
        meta.max_num_logprobs = vocab_size if (wanted == -1).any() else int(wanted.max())
    return meta


def _seen_tokens(state: SamplingState) -> SeenTokens:
    # Built from the prompt at the request's first sampled step, then kept up to date.
    if state.seen_tokens is None:
        state.seen_tokens = SeenTokens(state.token_ids[: state.num_prompt_tokens])
    state.seen_tokens.update(state.output_ids)
    return state.seen_tokens


def _add_penalties(
    meta: SamplingMetadata, states: list[SamplingState], arrays: SamplingArrays
) -> None:
    rows = np.flatnonzero(arrays.uses_penalties)
    seen = [_seen_tokens(states[i]) for i in rows.tolist()]
    # Flattened (row, token, output count) triples of every penalized row's seen tokens.
    meta.penalty_rows = torch.from_numpy(np.repeat(rows, [len(t.token_ids) for t in seen]))
    meta.penalty_token_ids = torch.from_numpy(np.concatenate([t.token_ids for t in seen]))
    meta.penalty_output_counts = torch.from_numpy(np.concatenate([t.output_counts for t in seen]))
    meta.repetition_penalty = torch.from_numpy(arrays.repetition_penalty)
    meta.presence_penalty = torch.from_numpy(arrays.presence_penalty)
    meta.frequency_penalty = torch.from_numpy(arrays.frequency_penalty)


def _bans(state: SamplingState, vocab: int) -> RequestBans:
    # Built at the request's first step with bans or biases, then kept with it.
    bans = getattr(state, "bans", None)
    if bans is None:
        bans = RequestBans(state.sampling_params, vocab)
        state.bans = bans
    return bans


def _add_bans_and_biases(
    meta: SamplingMetadata, states: list[SamplingState], rows: np.ndarray, vocab: int
) -> None:
    banned = []
    bias_rows, bias_ids, bias_values = [], [], []
    allowed_rows, allowed_masks = [], []
    for i in rows.tolist():
        s = states[i]
        p = s.sampling_params
        bans = _bans(s, vocab)
        row_bans = bans.bad_word_ends(s.output_ids)
        if len(s.output_ids) < p.min_tokens:
            row_bans += p.stop_token_ids
            if s.eos_token_id is not None and not p.ignore_eos:
                row_bans.append(s.eos_token_id)
        if row_bans:
            banned.append((i, row_bans))
        if bans.bias_ids is not None:
            bias_rows.append(torch.full((len(bans.bias_ids),), i, dtype=torch.long))
            bias_ids.append(bans.bias_ids)
            bias_values.append(bans.bias_values)
        if bans.allowed_mask is not None:
            allowed_rows.append(i)
            allowed_masks.append(bans.allowed_mask)
    meta.banned = banned or None
    if bias_rows:
        meta.logit_bias = (torch.cat(bias_rows), torch.cat(bias_ids), torch.cat(bias_values))
    if allowed_rows:
        meta.allowed_tokens = (torch.tensor(allowed_rows), torch.stack(allowed_masks))
