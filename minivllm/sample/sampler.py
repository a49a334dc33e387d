"""The sampler: one pass over the whole batch's logits, driven by per-row tensors.

Order, as in vLLM: logprobs of the raw distribution are taken first; then bans and biases
(min_tokens, bad words, allowed tokens, logit bias), penalties, temperature, top-k/top-p,
min-p, and the draw. Greedy rows take the argmax of the processed logits.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, fields

import torch

from minivllm.platforms import get_platform
from minivllm.structured_output.bitmask import apply_token_bitmask

_NEG_INF = float("-inf")


@dataclass
class SamplingMetadata:
    """Per-row sampling state for one step (rows = requests that sample this step)."""

    temperature: torch.Tensor  # [B] float; 0 marks greedy rows
    all_greedy: bool
    top_k: torch.Tensor | None  # [B] long, 0 = off; None when no row uses it
    top_p: torch.Tensor | None  # [B] float, 1 = off
    min_p: torch.Tensor | None  # [B] float, 0 = off
    generators: dict[int, torch.Generator]  # row -> the request's own seeded generator
    # Penalties, None when no row uses them.
    presence_penalty: torch.Tensor | None = None  # [B]
    frequency_penalty: torch.Tensor | None = None
    repetition_penalty: torch.Tensor | None = None
    # Each penalized row's distinct prompt and output tokens, flattened: row, token id, and
    # how many times the output has it (0 for a token only in the prompt). [N] each.
    penalty_rows: torch.Tensor | None = None
    penalty_token_ids: torch.Tensor | None = None
    penalty_output_counts: torch.Tensor | None = None
    # (row, token ids) banned this step: stop tokens under min_tokens, bad words' ends.
    banned: list[tuple[int, list[int]]] | None = None
    # (rows, token ids, bias values), flattened over every row with a logit_bias.
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # (rows, mask [len(rows), V] bool of allowed tokens) for rows with allowed_token_ids.
    allowed_tokens: tuple[torch.Tensor, torch.Tensor] | None = None
    # Structured outputs: (rows, [len(rows), ceil(V / 32)] int32 bitmask of allowed tokens).
    grammar: tuple[torch.Tensor, torch.Tensor] | None = None
    # Largest number of top logprobs any row asked for (-1 rows are resolved to V); None: off.
    max_num_logprobs: int | None = None

    def __post_init__(self) -> None:
        # What the sampler branches on, read while the tensors are still on the host, so
        # that sampling on a GPU never waits for it to answer.
        greedy = self.temperature == 0
        self.any_greedy = bool(greedy.any())
        self.any_scaled = bool(((self.temperature != 1.0) & ~greedy).any())
        top_k = self.top_k
        self.all_top_k = top_k is not None and bool((top_k > 0).all())
        self.max_top_k = int(top_k.max()) if self.all_top_k else 0

    @property
    def plain_greedy(self) -> bool:
        """Each row's draw is the argmax of its raw logits: nothing changes them first, and
        no logprobs are asked (a CUDA graph's argmax may stand for the sampler)."""
        return (
            self.all_greedy
            and self.max_num_logprobs is None
            and self.repetition_penalty is None
            and self.grammar is None
            and self.allowed_tokens is None
            and self.logit_bias is None
            and not self.banned
        )

    def to(self, device: torch.device) -> SamplingMetadata:
        """A copy whose tensors are on ``device`` (a tensor there already is kept)."""
        # From pinned memory: a copy from pageable memory may wait for the device's queue,
        # which under async scheduling holds the step before (CUDA's API sync rules).
        platform = get_platform(torch.device(device).type)

        def move(value):
            if isinstance(value, torch.Tensor):
                return platform.pinned(value).to(device, non_blocking=True)
            if isinstance(value, tuple):
                return tuple(move(v) for v in value)
            return value

        moved = copy.copy(self)
        for f in fields(self):
            if f.name != "generators":  # they live on the device already (the runner's)
                setattr(moved, f.name, move(getattr(self, f.name)))
        return moved


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B]
    # When logprobs were asked: the sampled token then the top-k, with their logprobs.
    logprob_token_ids: torch.Tensor | None = None  # [B, 1 + k]
    logprobs: torch.Tensor | None = None  # [B, 1 + k]
    sampled_ranks: torch.Tensor | None = None  # [B], 1-based rank of the sampled token


class Sampler:
    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """logits: [B, V] float32 (modified in place)."""
        raw_logprobs = (
            torch.log_softmax(logits, dim=-1) if meta.max_num_logprobs is not None else None
        )
        logits = apply_bans_and_biases(logits, meta)
        if meta.repetition_penalty is not None:
            logits = apply_penalties(logits, meta)
        sampled = self.sample(logits, meta)
        if raw_logprobs is None:
            return SamplerOutput(sampled)
        return SamplerOutput(
            sampled, *gather_logprobs(raw_logprobs, sampled, meta.max_num_logprobs)
        )

    def sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        if meta.all_greedy:
            return greedy_ids(logits)
        is_greedy = meta.temperature == 0
        # The argmax over the vocabulary costs a pass over [B, V]: only when a row needs it.
        greedy = greedy_ids(logits) if meta.any_greedy else None
        if meta.any_scaled:
            temperature = torch.where(is_greedy, 1.0, meta.temperature)
            logits = logits.div_(temperature.unsqueeze(1))
        candidates = None
        if meta.all_top_k:
            # Every row has a top-k: work on the max-k candidates only, not the vocabulary.
            logits, candidates = logits.topk(meta.max_top_k, dim=-1)
            ranks = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)
            logits = logits.masked_fill(ranks >= meta.top_k.unsqueeze(1), _NEG_INF)
            if meta.top_p is not None:
                logits = apply_top_p_sorted(logits, meta.top_p)
        else:
            logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
        probs = torch.softmax(logits, dim=-1)
        if meta.min_p is not None:
            probs = apply_min_p(probs, meta.min_p)
        sampled = random_sample(probs, meta.generators)
        if candidates is not None:
            sampled = candidates.gather(1, sampled.unsqueeze(1)).squeeze(1)
        return sampled if greedy is None else torch.where(is_greedy, greedy, sampled)


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax, by the fastest means of the logits' device."""
    return get_platform(logits.device.type).argmax(logits)


def apply_bans_and_biases(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    if meta.grammar is not None:
        apply_token_bitmask(logits, *meta.grammar)
    if meta.allowed_tokens is not None:
        rows, mask = meta.allowed_tokens
        logits[rows] = logits[rows].masked_fill(~mask, _NEG_INF)
    if meta.logit_bias is not None:
        rows, token_ids, bias = meta.logit_bias
        logits.index_put_((rows, token_ids), bias, accumulate=True)
    if meta.banned:
        for row, token_ids in meta.banned:
            logits[row, token_ids] = _NEG_INF
    return logits


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Repetition (prompt and output tokens), frequency and presence (output tokens).

    Only the seen (row, token) pairs are read and written: each pair appears once, so the
    scatter has no collisions."""
    rows, token_ids = meta.penalty_rows, meta.penalty_token_ids
    counts = meta.penalty_output_counts
    values = logits[rows, token_ids]
    rep = meta.repetition_penalty[rows]
    values = torch.where(values > 0, values / rep, values * rep)
    values = values - meta.frequency_penalty[rows] * counts
    values = values - meta.presence_penalty[rows] * (counts > 0)
    logits[rows, token_ids] = values
    return logits


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    if top_k is None and top_p is None:
        return logits
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
        kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, _NEG_INF)
    if top_p is not None:
        sorted_logits = apply_top_p_sorted(sorted_logits, top_p)
    return torch.full_like(logits, _NEG_INF).scatter_(1, sorted_idx, sorted_logits)


def apply_top_p_sorted(sorted_logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep a token while the mass of the tokens before it is below top_p (the first stays)."""
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    return sorted_logits.masked_fill(mass_before >= top_p.unsqueeze(1), _NEG_INF)


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return probs.masked_fill(probs < threshold, 0.0)


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Draw by inverting each row's CDF at one uniform number: a [B, V] cumulative sum, not
    B x V random numbers (drawing exponentials for the race argmax(p / q) cost a third of a
    decode step at B = 256). A seeded row draws only from its own generator, so its result
    ignores the rest of the batch."""
    uniform = torch.rand(probs.shape[0], device=probs.device)
    for row, generator in generators.items():
        uniform[row] = torch.rand(1, generator=generator, device=generator.device)
    cdf = probs.cumsum(dim=-1)
    # 1 - u lies in (0, 1], so the threshold is above zero and above the mass of every
    # token before the chosen one: a token of probability zero is never drawn.
    threshold = (1.0 - uniform).unsqueeze(1) * cdf[:, -1:]
    return torch.searchsorted(cdf, threshold).squeeze(1).clamp_(max=probs.shape[1] - 1)


def gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The logprob of token_ids and the top-k of each row: ([B, 1+k] ids, [B, 1+k], ranks)."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    if k > 0:
        top_values, top_ids = logprobs.topk(k, dim=-1)
        ids = torch.cat([token_ids.unsqueeze(1), top_ids], dim=1)
        values = torch.cat([chosen, top_values], dim=1)
    else:
        ids, values = token_ids.unsqueeze(1), chosen
    return ids, values, ranks
