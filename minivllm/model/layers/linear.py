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

On the CPU, ``pack_weights_for_cpu`` then hands every float32 weight to oneDNN in its
blocked layout once, after loading: its GEMM runs decode-shaped products 15-40% faster
than ``F.linear`` (MKL) here, and the 49,152-row LM head nearly 2x faster.
MINIVLLM_CPU_PACKED_LINEAR=0 keeps plain ``F.linear``. Batches of at most
SMALL_BATCH_ROWS rows (decoding one or a few sequences) are bound by streaming the
weights from memory, which the C kernel ``small_m_linear`` does ~40% faster than oneDNN;
it reads the plain weight, so that copy is kept too (MINIVLLM_CPU_SMALL_BATCH_LINEAR=0
turns it off and drops the copy).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minivllm import envs
from minivllm.distributed.parallel_state import TPGroup
from minivllm.kernels.cpu_kernels import load_kernels, small_m_linear
from minivllm.model.layers.quantization import gguf as gguf_quant

_SINGLE = TPGroup()


# oneDNN picks its blocking for a batch size; decode batches of this order are the hot path.
_PACKING_BATCH_HINT = 256


def cpu_packing_enabled(dtype: torch.dtype) -> bool:
    return (
        dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and envs.MINIVLLM_CPU_PACKED_LINEAR
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """The weight [out, in] reordered for oneDNN's GEMM (an opaque tensor, see linear)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACKING_BATCH_HINT)


SMALL_BATCH_ROWS = 4  # up to here the C kernel beats oneDNN on this machine's shapes


def linear(module: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T (+ bias) for any layer with a ``packed_weight`` slot: the small-batch kernel or
    oneDNN once pack_weights_for_cpu has run, plain ``F.linear`` otherwise; a weight kept in
    GGUF blocks goes to its kernels."""
    quantized = gguf_quant.quantized_weight(module.weight)
    if quantized is not None:
        return gguf_quant.apply(quantized, x, bias)
    if module.packed_weight is None:
        return F.linear(x, module.weight, bias)
    if module.small_batch_kernel is not None and x.dim() == 2 and x.shape[0] <= SMALL_BATCH_ROWS:
        return small_m_linear(module.small_batch_kernel, x, module.weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, module.packed_weight, bias, "none", [], "")


def pack_weights_for_cpu(model: nn.Module) -> None:
    """After loading, give every layer with a ``packed_weight`` slot its packed weight. The
    plain copy stays when the small-batch kernel reads it or another module uses it too (an
    LM head tied to the embedding); otherwise it is dropped."""
    kernel = load_kernels("MINIVLLM_CPU_SMALL_BATCH_LINEAR")
    packable = [m for m in model.modules() if hasattr(m, "packed_weight")]
    shared = {
        id(p)
        for m in model.modules()
        if not hasattr(m, "packed_weight")
        for p in m.parameters(recurse=False)
    }
    for module in packable:
        if gguf_quant.quantized_weight(module.weight) is not None:
            continue  # kept in GGUF blocks: the GGUF kernels read them as loaded
        module.packed_weight = pack_weight(module.weight)
        module.small_batch_kernel = kernel
        if kernel is None and id(module.weight) not in shared:
            module.weight.data = torch.empty(0)  # memory: only the packed copy is used now


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if isinstance(loaded, gguf_quant.GGUFTensor):
        gguf_quant.load_quantized(param, loaded)
        return
    if param.shape != loaded.shape:
        raise ValueError(
            f"shape mismatch: parameter {tuple(param.shape)}, checkpoint {tuple(loaded.shape)}"
        )
    param.data.copy_(loaded)


def divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what} ({total}) is not divisible by tensor_parallel_size={parts}")
    return total // parts


def _weight(out_features: int, in_features: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)


def _bias(out_features: int, bias: bool) -> nn.Parameter | None:
    return nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None


class Linear(nn.Module):
    """The same full weight on every rank."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = _weight(out_features, in_features)
        self.weight_rows = out_features  # this rank's (the parameter empties when quantized)
        self.bias = _bias(out_features, bias)
        self.packed_weight: torch.Tensor | None = None
        self.small_batch_kernel = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(self, x, self.bias)


class ColumnParallelLinear(Linear):
    """y[:, rank's slice] = x W[rank's rows]^T: each rank holds out_features / tp rows."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, tp: TPGroup = _SINGLE
    ) -> None:
        super().__init__(in_features, divide(out_features, tp.size, "output features"), bias)
        self.tp = tp
        for param in (self.weight, self.bias):
            if param is not None:
                param.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        size = self.weight_rows
        default_weight_loader(param, loaded.narrow(0, self.tp.rank * size, size))


class MergedColumnParallelLinear(Linear):
    """Column-parallel projections of one input, fused: [shard 0 | shard 1 | ...] per rank.

    Each rank holds its slice of every shard, shards side by side; weight_loader(param,
    t, shard_id) cuts the rank's rows out of the full checkpoint tensor ``t``.
    """

    def __init__(
        self, in_features: int, shard_sizes: dict, bias: bool = False, tp: TPGroup = _SINGLE
    ) -> None:
        local = {k: divide(v, tp.size, f"projection {k!r}") for k, v in shard_sizes.items()}
        super().__init__(in_features, sum(local.values()), bias)
        self.tp = tp
        # shard id -> (offset in this rank's parameter, rows, first checkpoint row it takes)
        self.shard_layout: dict = {}
        offset = 0
        for shard_id, size in local.items():
            self.shard_layout[shard_id] = (offset, size, tp.rank * size)
            offset += size
        for param in (self.weight, self.bias):
            if param is not None:
                param.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id) -> None:
        offset, size, start = self.shard_layout[shard_id]
        full = size * self.full_shard_multiple(shard_id)
        if loaded.shape[0] != full:
            raise ValueError(f"shard {shard_id!r}: expected {full} rows, got {loaded.shape[0]}")
        if isinstance(loaded, gguf_quant.GGUFTensor):
            if param is self.weight:
                gguf_quant.load_quantized(param, loaded.narrow_rows(start, size), offset)
                return
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
        super().__init__(hidden, sizes, bias, tp)
        # A replicated KV head: the rank takes head rank // replicas of the checkpoint.
        kv_start = (tp.rank // self.kv_replicas) * kv
        self.shard_layout = {"q": (0, q, tp.rank * q), "k": (q, kv, kv_start)}
        self.shard_layout["v"] = (q + kv, kv, kv_start)
        self.q_size = q
        self.kv_size = kv

    def full_shard_multiple(self, shard_id) -> int:
        return self.tp.size if shard_id == "q" else self.tp.size // self.kv_replicas


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x[:, rank's slice] W[:, rank's columns]^T, plus the bias."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, tp: TPGroup = _SINGLE
    ) -> None:
        super().__init__()
        self.tp = tp
        self.in_features_per_rank = divide(in_features, tp.size, "input features")
        self.weight = _weight(out_features, self.in_features_per_rank)
        self.bias = _bias(out_features, bias)  # whole on every rank, added after the sum
        self.weight.weight_loader = self.weight_loader
        self.packed_weight: torch.Tensor | None = None
        self.small_batch_kernel = None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        size = self.in_features_per_rank
        if isinstance(loaded, gguf_quant.GGUFTensor):
            gguf_quant.load_quantized(param, loaded.narrow_columns(self.tp.rank * size, size))
            return
        default_weight_loader(param, loaded.narrow(1, self.tp.rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return linear(self, x, self.bias)
        out = self.tp.all_reduce(linear(self, x, None))
        return out if self.bias is None else out + self.bias
