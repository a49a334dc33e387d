"""Logprob: one candidate token's log probability, with vLLM's fields."""

from __future__ import annotations

from dataclasses import dataclass

# Per position: token id -> Logprob (the sampled or prompt token first, then the top-k).
PositionLogprobs = dict[int, "Logprob"]


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None


def make_position_logprobs(
    token_ids: list[int], logprobs: list[float], rank: int, decode
) -> PositionLogprobs:
    """The chosen token (first, with its rank) and the top-k (ranks 1..k)."""
    result: PositionLogprobs = {}
    for i, (token_id, value) in enumerate(zip(token_ids, logprobs)):
        if token_id in result:
            continue  # the chosen token is also in the top-k
        result[token_id] = Logprob(value, rank if i == 0 else i, decode(token_id))
    return result
