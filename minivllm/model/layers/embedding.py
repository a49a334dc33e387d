"""The vocabulary-parallel embedding and LM head: each rank holds a slice of the vocabulary.

The vocabulary is cut into ``tp`` equal slices of ``ceil(vocab / tp)`` rows; the rows past
the real vocabulary (on the last rank) are zero and are cut off the gathered logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.distributed.parallel_state import TPGroup
from minivllm.kernels.cpu_kernels import panel_rows
from minivllm.model.layers.quantization.base import (
    QuantizationConfig,
    QuantizedTensor,
    UsesLinearMethod,
    linear_method_for,
    quantized_weight,
)

_SINGLE = TPGroup()


class VocabParallelEmbedding(nn.Module):
    """quant_config: a format that may keep a float checkpoint's table quantized
    (``QuantizationConfig.embedding_table``: online quantization)."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        tp: TPGroup = _SINGLE,
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        super().__init__()
        self.quant_config = quant_config
        self.tp = tp
        self.vocab_size = vocab_size
        self.rows_per_rank = -(-vocab_size // tp.size)
        self.vocab_start = tp.rank * self.rows_per_rank
        self.hidden_size = hidden_size
        self.weight = nn.Parameter(
            torch.empty(self.rows_per_rank, hidden_size), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.shape[0] != self.vocab_size or tuple(loaded.shape[1:]) != (self.hidden_size,):
            raise ValueError(
                f"shape mismatch: vocabulary {self.vocab_size} x {self.hidden_size}, "
                f"checkpoint {tuple(loaded.shape)}"
            )
        rows = min(self.rows_per_rank, self.vocab_size - self.vocab_start)
        if self.quant_config is not None and not isinstance(loaded, QuantizedTensor):
            kept = self.quant_config.embedding_table(loaded)
            loaded = loaded if kept is None else kept
        if isinstance(loaded, QuantizedTensor):  # kept in its format, zero rows past the end
            loaded.narrow(0, self.vocab_start, rows).pad_rows(self.rows_per_rank).load_into(param)
            return
        param.data[:rows].copy_(loaded.narrow(0, self.vocab_start, rows))
        param.data[rows:].zero_()

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        quantized = quantized_weight(self.weight)
        if quantized is not None:  # dequantize only the rows gathered
            return quantized.rows(ids)
        panels = getattr(self.weight, "panels", None)
        if panels is not None:  # a tied LM head's table, kept only in its panels
            return panel_rows(panels, ids)
        return F.embedding(ids, self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.lookup(input_ids)
        # Ids outside this rank's slice look up row 0 and are zeroed; the sum over ranks
        # leaves each token the one row its owner contributed.
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.rows_per_rank)
        out = self.lookup(local.masked_fill(outside, 0))
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding, UsesLinearMethod):
    """hidden -> float32 logits over the vocabulary; may share the embedding's weight.

    Its ``quant_method`` (as a linear layer's, picked by ``quant_config``) multiplies by
    the weight; a tied head runs in the embedding's format (quantized blocks included).

    With several ranks each computes its slice of the logits and rank 0 gathers them:
    ``forward`` returns None on the other ranks, which do not sample.
    """

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        tp: TPGroup = _SINGLE,
        tied_to: VocabParallelEmbedding | None = None,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "lm_head",
    ) -> None:
        super().__init__(vocab_size, hidden_size, tp)
        if tied_to is not None:
            self.weight = tied_to.weight
        self.weight_is_shared = tied_to is not None  # the embedding reads it too
        self.quant_method = linear_method_for(quant_config, self, prefix)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.quant_method.apply(self, hidden).float()
        if self.tp.size == 1:
            return logits
        full = self.tp.gather_to_first(logits, dim=-1)
        return None if full is None else full[..., : self.vocab_size]
