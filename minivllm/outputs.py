"""What the user gets back: RequestOutput and CompletionOutput, with vLLM's fields."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class CompletionOutput:
    """One generated sequence of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list | None = None
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The output of one request, as vLLM's `RequestOutput`."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)


@dataclass
class PoolingOutput:
    """A pooling request's result: its embedding (float32, on the host)."""

    data: torch.Tensor


@dataclass
class PoolingRequestOutput:
    """The output of one pooling request (``LLM.encode``, ``AsyncLLM.encode``), as vLLM's."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool
    num_cached_tokens: int = 0
    prompt: str | None = None
    # "stop" once pooled; "abort", or "error" when it failed alone (then data is empty).
    finish_reason: str | None = None

    @classmethod
    def with_outputs(cls, output: PoolingRequestOutput, outputs):
        """``output``'s fields, as this class, with ``outputs`` for the pooled tensor (the
        task's own output: an embedding, class probabilities, a score)."""
        values = {f.name: getattr(output, f.name) for f in fields(output)}
        return cls(**{**values, "outputs": outputs})


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput(PoolingRequestOutput):
    """What ``LLM.embed`` returns per prompt, as vLLM's: ``.outputs`` is an EmbeddingOutput
    (``.outputs.embedding``, a list of floats)."""

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> EmbeddingRequestOutput:
        return cls.with_outputs(output, EmbeddingOutput(output.outputs.data.tolist()))


@dataclass
class ScoringOutput:
    """A pair's score: a cross-encoder's activated logit, or the cosine similarity of the
    pair's two embeddings."""

    score: float


@dataclass
class ScoringRequestOutput(PoolingRequestOutput):
    """What ``LLM.score`` returns per pair, as vLLM's: ``.outputs.score``, a float;
    ``prompt_token_ids``: a cross-encoder's pair prompt, or (embedding models) the first
    text's ids, the pad token (if the tokenizer has one), then the second's."""

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> ScoringRequestOutput:
        """A cross-encoder's output: its one activated logit is the score."""
        return cls.with_outputs(output, ScoringOutput(output.outputs.data.item()))


@dataclass
class ClassificationOutput:
    """A classifier's activated logits: the softmax of them (a sigmoid for one label), or the
    raw logits when the request says use_activation=False."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput(PoolingRequestOutput):
    """What ``LLM.classify`` returns per prompt, as vLLM's: ``.outputs.probs``."""

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> ClassificationRequestOutput:
        return cls.with_outputs(output, ClassificationOutput(output.outputs.data.tolist()))
