"""Linear layers whose parameters own their loading and their tensor-parallel sharding.

Every parameter carries ``weight_loader(param, full_tensor[, shard_id])``: it is handed
the whole checkpoint tensor and copies in the slice its rank holds. The model's loader
only walks checkpoint names, so no model has sharding code of its own.

- ``Linear``: replicated on every rank.
- ``ColumnParallelLinear``: output features split across ranks; the output stays split.
- ``MergedColumnParallelLinear``: several column-parallel projections of one input fused
  into one matmul (gate/up); ``QKVParallelLinear`` is the q/k/v case, split by heads.
- ``RowParallelLinear``: input features split; the partial products are summed over
  the ranks (all-reduce), and the bias is added once, after the sum.

With one rank (``TPGroup()``) each is a plain ``F.linear`` with the full weight.

Every one is a ``LinearBase``: its ``quant_method`` (picked by the model's
``quant_config``, dense by default; see ``quantization/``) creates the weight, loads the
part the layer cuts out of a checkpoint tensor (dense, or a ``QuantizedTensor`` the layer
cuts alike), reworks it after loading and multiplies by it: ``forward`` is
``quant_method.apply(self, x, bias)``.
"""

from __future__ import annotations

import torch
from torch import nn

from minivllm.distributed.parallel_state import TPGroup
from minivllm.model.layers.quantization.base import (
    QuantizationConfig,
    QuantizedTensor,
    UsesLinearMethod,
    default_weight_loader,
    linear_method_for,
)

__all__ = ["default_weight_loader"]  # weight_loading.py's, for parameters without their own

_SINGLE = TPGroup()


def divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what} ({total}) is not divisible by tensor_parallel_size={parts}")
    return total // parts


class LinearBase(nn.Module, UsesLinearMethod):
    """A linear layer whose weight its ``quant_method`` creates, reworks after loading and
    multiplies by. Subclasses say how the weight is partitioned and loaded."""

    weight_is_shared = False  # no other module uses this weight (see the LM head)
    lora = None  # a LinearLoRA (lora/layers.py) when the engine serves adapters

    def __init__(
        self,
        input_size: int,
        output_size: int,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.quant_method = linear_method_for(quant_config, self, prefix)

    def create_weights(
        self, input_size_per_partition: int, output_partition_sizes: list[int], bias: bool
    ) -> None:
        """This rank's weight (through the method) and bias ([output rows], or None)."""
        self.quant_method.create_weights(
            self,
            input_size_per_partition,
            output_partition_sizes,
            self.input_size,
            self.output_size,
            torch.get_default_dtype(),
            weight_loader=self.weight_loader,
        )
        self.bias = (
            nn.Parameter(torch.empty(sum(output_partition_sizes)), requires_grad=False)
            if bias
            else None
        )
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        self.quant_method.load_weight(self, param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.quant_method.apply(self, x, self.bias)
        if self.lora is not None:
            self.lora.add_to(x, out)
        return out


class Linear(LinearBase):
    """The same full weight on every rank (vLLM's ``ReplicatedLinear``)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__(in_features, out_features, quant_config, prefix)
        self.create_weights(in_features, [out_features], bias)


class ColumnParallelLinear(LinearBase):
    """y[:, rank's slice] = x W[rank's rows]^T: each rank holds out_features / tp rows."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        tp: TPGroup = _SINGLE,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__(in_features, out_features, quant_config, prefix)
        self.tp = tp
        self.output_size_per_partition = divide(out_features, tp.size, "output features")
        self.create_weights(in_features, [self.output_size_per_partition], bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        size = self.output_size_per_partition
        self.quant_method.load_weight(self, param, loaded.narrow(0, self.tp.rank * size, size))


class MergedColumnParallelLinear(LinearBase):
    """Column-parallel projections of one input, fused: [shard 0 | shard 1 | ...] per rank.

    Each rank holds its slice of every shard, shards side by side; weight_loader(param,
    t, shard_id) cuts the rank's rows out of the full checkpoint tensor ``t``.
    """

    def __init__(
        self,
        in_features: int,
        shard_sizes: dict,
        bias: bool = False,
        tp: TPGroup = _SINGLE,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), quant_config, prefix)
        local = {k: divide(v, tp.size, f"projection {k!r}") for k, v in shard_sizes.items()}
        self.tp = tp
        # shard id -> (offset in this rank's parameter, rows, first checkpoint row it takes)
        self.shard_layout: dict = {}
        offset = 0
        for shard_id, size in local.items():
            self.shard_layout[shard_id] = (offset, size, tp.rank * size)
            offset += size
        self.create_weights(in_features, list(local.values()), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id) -> None:
        offset, size, start = self.shard_layout[shard_id]
        full = size * self.full_shard_multiple(shard_id)
        if loaded.shape[0] != full:
            raise ValueError(f"shard {shard_id!r}: expected {full} rows, got {loaded.shape[0]}")
        if param is self.weight:
            self.quant_method.load_shard(self, loaded.narrow(0, start, size), offset)
            return
        if isinstance(loaded, QuantizedTensor):
            loaded = loaded.dequantize()  # a quantized bias (never written by llama.cpp)
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, start, size))

    def full_shard_multiple(self, shard_id) -> int:
        """How many ranks' slices make up the checkpoint tensor of a shard."""
        return self.tp.size


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k and v fused, split by heads: each rank holds num_heads / tp query heads and
    num_kv_heads / tp key/value heads. When there are fewer KV heads than ranks, each KV
    head is replicated on tp / num_kv_heads consecutive ranks."""

    def __init__(
        self,
        hidden: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        tp: TPGroup = _SINGLE,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        self.num_heads = divide(num_heads, tp.size, "num_attention_heads")
        if num_kv_heads >= tp.size:
            self.num_kv_heads = divide(num_kv_heads, tp.size, "num_key_value_heads")
            self.kv_replicas = 1
        else:
            self.num_kv_heads = 1
            self.kv_replicas = divide(tp.size, num_kv_heads, "tensor_parallel_size")
        q, kv = self.num_heads * head_dim, self.num_kv_heads * head_dim
        sizes = {"q": q * tp.size, "k": kv * tp.size, "v": kv * tp.size}
        super().__init__(hidden, sizes, bias, tp, quant_config, prefix)
        # A replicated KV head: the rank takes head rank // replicas of the checkpoint.
        kv_start = (tp.rank // self.kv_replicas) * kv
        self.shard_layout = {"q": (0, q, tp.rank * q), "k": (q, kv, kv_start)}
        self.shard_layout["v"] = (q + kv, kv, kv_start)
        self.q_size = q
        self.kv_size = kv

    def full_shard_multiple(self, shard_id) -> int:
        return self.tp.size if shard_id == "q" else self.tp.size // self.kv_replicas


class RowParallelLinear(LinearBase):
    """y = sum over ranks of x[:, rank's slice] W[:, rank's columns]^T, plus the bias."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        tp: TPGroup = _SINGLE,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__(in_features, out_features, quant_config, prefix)
        self.tp = tp
        self.in_features_per_rank = divide(in_features, tp.size, "input features")
        self.create_weights(self.in_features_per_rank, [out_features], bias)
        if self.bias is not None:  # whole on every rank, added after the sum
            self.bias.weight_loader = default_weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        size = self.in_features_per_rank  # a quantized tensor's columns: whole blocks only
        self.quant_method.load_weight(self, param, loaded.narrow(1, self.tp.rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(x)
        partial = self.quant_method.apply(self, x)
        if self.lora is not None:  # this rank's share of the delta, summed with the rest
            self.lora.add_to(x, partial)
        out = self.tp.all_reduce(partial)
        return out if self.bias is None else out + self.bias
