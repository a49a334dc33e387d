"""The sampler: one pass over the whole batch's logits, driven by per-request tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
    output_token_counts: torch.Tensor | None = None  # [B, V] counts of generated tokens
    prompt_token_mask: torch.Tensor | None = None  # [B, V] bool, tokens in the prompt
    # Rows whose stop tokens (EOS, stop_token_ids) are banned until min_tokens are out.
    min_tokens_ban: list[tuple[int, list[int]]] | None = None


class Sampler:
    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """logits: [B, V] float32 -> sampled token ids [B]."""
        if meta.min_tokens_ban:
            for row, token_ids in meta.min_tokens_ban:
                logits[row, token_ids] = _NEG_INF
        if meta.repetition_penalty is not None:
            logits = apply_penalties(logits, meta)
        greedy = logits.argmax(dim=-1)
        if meta.all_greedy:
            return greedy
        is_greedy = meta.temperature == 0
        temperature = torch.where(is_greedy, 1.0, meta.temperature)
        logits = logits / temperature.unsqueeze(1)
        logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
        probs = torch.softmax(logits, dim=-1)
        if meta.min_p is not None:
            probs = apply_min_p(probs, meta.min_p)
        sampled = random_sample(probs, meta.generators)
        return torch.where(is_greedy, greedy, sampled)


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Repetition (prompt and output tokens), frequency and presence (output tokens)."""
    counts = meta.output_token_counts
    seen = meta.prompt_token_mask | (counts > 0)
    rep = meta.repetition_penalty.unsqueeze(1)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    logits = logits - meta.frequency_penalty.unsqueeze(1) * counts
    return logits - meta.presence_penalty.unsqueeze(1) * (counts > 0)


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
        probs = sorted_logits.softmax(dim=-1)
        # Keep a token while the mass of the tokens before it is below top_p (the first stays).
        mass_before = probs.cumsum(dim=-1) - probs
        sorted_logits = sorted_logits.masked_fill(mass_before >= top_p.unsqueeze(1), _NEG_INF)
    return torch.full_like(logits, _NEG_INF).scatter_(1, sorted_idx, sorted_logits)


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return probs.masked_fill(probs < threshold, 0.0)


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Sample by the exponential race argmax(p / q), q ~ Exp(1): no host sync, and a seeded
    row draws only from its own generator, so its result ignores the rest of the batch."""
    q = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        q.exponential_()
    for row, generator in generators.items():
        q[row].exponential_(generator=generator)
    return probs.div(q).argmax(dim=-1)
