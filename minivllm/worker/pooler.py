"""The pooling runner's pooler: one embedding per prompt from the model's final hidden states.

A prompt may be computed in chunks (chunked prefill), so what a pooling type needs is
gathered chunk by chunk: MEAN sums every row, CLS keeps position 0's row, LAST needs only
the row of the prompt's last token, in the step that computes it. Then the embedding is
cut to the request's ``dimensions`` (matryoshka models) and L2-normalized, in that order,
as vLLM and sentence-transformers do.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from minivllm.config import PoolerConfig
from minivllm.pooling_params import PoolingParams

Activation = Callable[[torch.Tensor], torch.Tensor]


def _by_num_labels(logits: torch.Tensor) -> torch.Tensor:
    """One label: its probability (sigmoid); more: a distribution over them (softmax)."""
    return torch.sigmoid(logits) if logits.shape[-1] < 2 else torch.softmax(logits, dim=-1)


def classify_activation(hf_config) -> Activation:
    """The activation of a classifier's logits for "classify", as vLLM's: the one its
    transformers loss implies (problem_type), else by the number of labels."""
    problem_type = getattr(hf_config, "problem_type", None)
    if problem_type == "regression":
        return lambda logits: logits
    if problem_type == "multi_label_classification":
        return torch.sigmoid
    return _by_num_labels


def score_activation(hf_config) -> Activation:
    """The activation of a cross-encoder's logit for "score": the sentence-transformers
    CrossEncoder's own when its config names one (a torch.nn module, as vLLM allows), else
    by the number of labels (sigmoid for the usual one)."""
    name = (getattr(hf_config, "sentence_transformers", None) or {}).get("activation_fn")
    name = name or getattr(hf_config, "sbert_ce_default_activation_function", None)
    if name is None:
        return _by_num_labels
    # A config file names code to run: only torch's own modules, as vLLM restricts it.
    module_name, _, class_name = name.rpartition(".")
    if not module_name.startswith("torch.nn.modules"):
        raise ValueError(
            f"The cross-encoder's activation {name!r} is not a torch.nn module; loading "
            "activation functions is restricted to torch.nn.modules."
        )
    module_cls = getattr(importlib.import_module(module_name), class_name, None)
    if not (isinstance(module_cls, type) and issubclass(module_cls, torch.nn.Module)):
        raise ValueError(f"The cross-encoder's activation {name!r} is not a torch.nn module.")
    if module_cls is torch.nn.Identity:
        return lambda logits: logits
    if module_cls in (torch.nn.Sigmoid, torch.nn.Softmax):
        return _by_num_labels
    return module_cls()


@dataclass
class PoolingState:
    """What a request's earlier chunks left for its pooling (rebuilt after preemption)."""

    params: PoolingParams
    num_prompt_tokens: int
    total: torch.Tensor | None = None  # MEAN: the sum of the rows so far, float32
    first: torch.Tensor | None = None  # CLS: position 0's row, float32


class Pooler:
    def __init__(
        self,
        config: PoolerConfig,
        classifier: torch.nn.Linear | None = None,
        activations: dict[str, Activation] | None = None,
    ) -> None:
        """classifier: a sequence classifier's head (its ``score`` layer): the pooled vector
        becomes its logits, through the activation of the request's task ("classify",
        "score"; none when the request says use_activation=False)."""
        self.pooling_type = config.pooling_type or "LAST"
        self.normalize = config.normalize is not False
        self.classifier = classifier
        self.activations = activations or {}
        # LAST reads the finishing rows only; the others read every chunk's rows.
        self.reads_every_chunk = self.pooling_type != "LAST"

    def add_chunk(self, state: PoolingState, rows: torch.Tensor, first_position: int) -> None:
        """A computed chunk of the prompt: its hidden rows, the first at first_position."""
        if self.pooling_type == "MEAN":
            chunk = rows.float().sum(0)
            state.total = chunk if state.total is None else state.total + chunk
        elif self.pooling_type == "CLS" and first_position == 0:
            state.first = rows[0].float()

    def pool(self, states: list[PoolingState], last_rows: torch.Tensor) -> list[list[float]]:
        """The embeddings of requests whose prompt is now done (last_rows: the row of each
        one's last prompt token), on the host after one copy."""
        vectors = []
        for state, last in zip(states, last_rows):
            if self.pooling_type == "MEAN":
                vector = state.total / state.num_prompt_tokens
            elif self.pooling_type == "CLS":
                vector = state.first
            else:
                vector = last.float()
            params = state.params
            if self.classifier is not None:
                logits = self.classifier(vector.to(self.classifier.weight.dtype)).float()
                if params.use_activation is not False:
                    logits = self.activations[params.task or "classify"](logits)
                vectors.append(logits)
                continue
            if params.dimensions is not None:
                vector = vector[: params.dimensions]
            if params.normalize if params.normalize is not None else self.normalize:
                vector = torch.nn.functional.normalize(vector, p=2, dim=-1)
            vectors.append(vector)
        values = torch.cat(vectors).cpu().tolist()
        out, start = [], 0
        for vector in vectors:
            out.append(values[start : start + len(vector)])
            start += len(vector)
        return out
