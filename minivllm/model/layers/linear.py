"""Linear layers whose parameters own their loading (and, later, their sharding)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(
            f"shape mismatch: parameter {tuple(param.shape)}, checkpoint {tuple(loaded.shape)}"
        )
    param.data.copy_(loaded)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of the same input fused into one matmul (gate/up, q/k/v).

    Each checkpoint tensor lands at its shard's row offset: weight_loader(param, t, shard).
    """

    def __init__(self, in_features: int, shard_sizes: dict, bias: bool = False) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias)
        self.shard_offsets = {}
        offset = 0
        for shard_id, size in shard_sizes.items():
            self.shard_offsets[shard_id] = (offset, size)
            offset += size
        for param in (self.weight, self.bias):
            if param is not None:
                param.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id) -> None:
        offset, size = self.shard_offsets[shard_id]
        if loaded.shape[0] != size:
            raise ValueError(f"shard {shard_id!r}: expected {size} rows, got {loaded.shape[0]}")
        param.data.narrow(0, offset, size).copy_(loaded)


class QKVLinear(MergedLinear):
    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool):
        super().__init__(
            hidden,
            {"q": num_heads * head_dim, "k": num_kv_heads * head_dim, "v": num_kv_heads * head_dim},
            bias,
        )
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
