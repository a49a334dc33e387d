"""The engine's per-token logprobs (vLLM's shape: one dict token id -> Logprob per generated
token, holding the sampled token and the top ones) as the OpenAI responses carry them."""

from __future__ import annotations

from minivllm.entrypoints.openai.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    CompletionLogProbs,
)

# JSON has no -inf; vLLM sends this instead.
_MIN_LOGPROB = -9999.0


def _value(entry) -> float:
    value = getattr(entry, "logprob", entry)
    return max(float(value), _MIN_LOGPROB)


def _rank(entry) -> int:
    rank = getattr(entry, "rank", None)
    return rank if rank is not None else 1 << 30


class TokenNames:
    """How a token id is shown: its decoded text, or "token_id:N" when asked."""

    def __init__(self, tokenizer, as_token_ids: bool) -> None:
        self.tokenizer = tokenizer
        self.as_token_ids = as_token_ids

    def __call__(self, token_id: int, entry=None) -> str:
        if self.as_token_ids:
            return f"token_id:{token_id}"
        decoded = getattr(entry, "decoded_token", None)
        if decoded is None:
            decoded = self.tokenizer.decode([token_id])
        return decoded


def _top(step: dict, num_top: int) -> list[tuple[int, object]]:
    """The step's num_top best (token id, entry) pairs, best first."""
    return sorted(step.items(), key=lambda item: _rank(item[1]))[:num_top]


def completion_logprobs(
    token_ids: list[int],
    steps: list[dict | None],
    num_top: int,
    names: TokenNames,
    text_offset: int = 0,
) -> tuple[CompletionLogProbs, int]:
    """Completions' logprobs for these tokens, and the text offset after them.

    A step may be None: the first prompt token of an echoed prompt has no logprob.
    """
    result = CompletionLogProbs()
    for token_id, step in zip(token_ids, steps):
        entry = step.get(token_id) if step is not None else None
        token = names(token_id, entry)
        result.tokens.append(token)
        result.text_offset.append(text_offset)
        text_offset += len(token)
        if step is None:
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            continue
        result.token_logprobs.append(_value(entry) if entry is not None else None)
        top = {names(i, e): _value(e) for i, e in _top(step, num_top)}
        if entry is not None:
            top.setdefault(token, _value(entry))
        result.top_logprobs.append(top)
    return result, text_offset


def prompt_logprobs_json(steps: list[dict | None] | None) -> list | None:
    """vLLM's prompt_logprobs field: per prompt token, token id -> its Logprob's fields."""
    if steps is None:
        return None
    return [
        None
        if step is None
        else {
            str(token_id): {
                "logprob": _value(entry),
                "rank": getattr(entry, "rank", None),
                "decoded_token": getattr(entry, "decoded_token", None),
            }
            for token_id, entry in step.items()
        }
        for step in steps
    ]


def chat_logprobs(
    token_ids: list[int], steps: list[dict], num_top: int, names: TokenNames
) -> ChatCompletionLogProbs:
    content = []
    for token_id, step in zip(token_ids, steps):
        entry = step.get(token_id)
        token = names(token_id, entry)
        content.append(
            ChatCompletionLogProbsContent(
                token=token,
                logprob=_value(entry) if entry is not None else _MIN_LOGPROB,
                bytes=list(token.encode("utf-8", errors="replace")),
                top_logprobs=[
                    ChatCompletionLogProb(
                        token=(name := names(i, e)),
                        logprob=_value(e),
                        bytes=list(name.encode("utf-8", errors="replace")),
                    )
                    for i, e in _top(step, num_top)
                ],
            )
        )
    return ChatCompletionLogProbs(content=content)
