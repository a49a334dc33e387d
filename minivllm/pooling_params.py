"""PoolingParams: what one pooling request (an embedding) asks for, with vLLM's fields."""

from __future__ import annotations

import msgspec

from minivllm.sampling_params import check_int

# The pooling tasks this engine serves (vLLM also has token_embed, ...): "embed" on an
# embedding model; "classify" and "score" (a cross-encoder's one logit over a text pair) on a
# sequence classifier.
POOLING_TASKS = ("embed", "classify", "score")


class PoolingParams(msgspec.Struct, omit_defaults=True):
    """A msgspec struct, as SamplingParams, so that it crosses the process boundary as msgpack."""

    # Keep the prompt's last k tokens (-1: max_model_len), as SamplingParams' field does.
    truncate_prompt_tokens: int | None = None
    # Matryoshka models: keep the embedding's first `dimensions` values (then normalize).
    dimensions: int | None = None
    # None: the model's pooler config says (normalized by default for embeddings).
    normalize: bool | None = None
    task: str | None = None  # None: the model's own (ModelConfig.pooling_task)
    # classify and score: False returns the classifier's raw logits; None or True applies the
    # model's activation (softmax, or sigmoid for one label; a cross-encoder's own for score).
    use_activation: bool | None = None

    def __post_init__(self) -> None:
        for name in ("truncate_prompt_tokens", "dimensions"):
            value = getattr(self, name)
            if value is not None:
                check_int(value, name)
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions must be at least 1, got {self.dimensions}.")
        if self.truncate_prompt_tokens is not None and not (
            self.truncate_prompt_tokens == -1 or self.truncate_prompt_tokens >= 1
        ):
            raise ValueError(
                f"truncate_prompt_tokens must be >= 1 or -1, got {self.truncate_prompt_tokens}."
            )
        for name in ("normalize", "use_activation"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be a boolean, got {value!r}.")
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(
                f"Pooling task {self.task!r} is not supported; this engine serves "
                f"{', '.join(POOLING_TASKS)}."
            )

    def clone(self) -> PoolingParams:
        return msgspec.structs.replace(self)
