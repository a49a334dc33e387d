"""GGUF weights kept in their quantized blocks (``quantization="gguf"``): ``GGUFConfig``
gives every linear layer and the LM head a ``GGUFLinearMethod``.

The loader yields a ``GGUFTensor`` (the tensor's bytes as stored, [rows, bytes per row],
and its GGML type) in place of a dequantized tensor for every quantized matrix. A layer's
weight loader cuts it (``narrow``: rows, or for a row-parallel layer the block-aligned
columns) and hands it to the method, and ``load_quantized`` keeps it as a ``GGUFWeight`` on
the parameter (``param.quantized``) and drops the parameter's float storage.
``GGUFLinearMethod.apply`` multiplies by it; a layer whose tensor the file stores
unquantized (F32/F16/BF16) was loaded dense, and becomes an ``UnquantizedLinearMethod``
layer after loading.

- default: activations quantized to int8 per 32 values, integer dot products. After
  loading, each layer merges neighbouring shards of one type (q/k/v, gate/up) and repacks
  them once into the tiled layout of ``gguf_kernels.matmul_packed`` (16 rows interleaved;
  most types at the file's size, Q3_K 4%, IQ4_XS 6% and Q4_K/Q5_K 9-11% above it: float16
  scales per row in place of their 6-bit factors; the IQ1-IQ3 grid types at 3.56 or 4.56
  bits a weight, an index of their few levels per weight);
- MINIVLLM_GGUF_KERNEL=f32: the blocks stay as loaded and are dequantized to float32 a
  tile at a time (``matmul_f32``), the same products as the float32-dequantized model.

Fused layers (q/k/v, gate/up) may hold shards of different types (Q4_K_M files keep v and
down in Q6_K): each shard is a segment with its own type, multiplied separately. A shard the
file stores unquantized, or in a type the kernels lack (read dense: TQ1_0, TQ2_0, MXFP4, or
F16 beside Q8_0), is a dense float32 segment of the same weight (``load_shard``). The
weight sits on the parameter, not the module, so an LM head tied to the embedding shares it
and runs quantized too; the embedding dequantizes only the rows it gathers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from minivllm import envs
from minivllm.kernels import cpu_kernels, gguf_kernels
from minivllm.model.layers.quantization.base import (
    LinearMethodBase,
    QuantizationConfig,
    QuantizedTensor,
    QuantizedWeight,
    UnquantizedLinearMethod,
    UsesLinearMethod,
    create_dense_weight,
    quantized_weight,
)
from minivllm.model.layers.quantization.mxfp4 import mxfp4_as_gguf_blocks

__all__ = ["GGUFConfig", "GGUFLinearMethod", "GGUFTensor", "GGUFWeight", "quantized_weight"]


@dataclass
class GGUFTensor(QuantizedTensor):
    """A checkpoint tensor in GGUF blocks: ``raw`` [rows, bytes per row] uint8."""

    raw: torch.Tensor
    qtype: int
    shape: tuple[int, int]  # [rows, in_features], as the dequantized tensor
    packed: bool = False  # raw holds gguf_kernels.pack's layout (flat), not the file's blocks

    def narrow(self, dim: int, start: int, length: int) -> GGUFTensor:
        return self.narrow_rows(start, length) if dim == 0 else self.narrow_columns(start, length)

    def narrow_rows(self, start: int, length: int) -> GGUFTensor:
        return GGUFTensor(self.raw.narrow(0, start, length), self.qtype, (length, self.shape[1]))

    def narrow_columns(self, start: int, length: int) -> GGUFTensor:
        """Columns [start, start + length): whole blocks only."""
        block, size = gguf_kernels.BLOCK_SIZES[self.qtype]
        if start % block or length % block:
            raise ValueError(
                f"cannot split a {gguf_kernels_type_name(self.qtype)} weight of "
                f"{self.shape[1]} input features at column {start} (+{length}): the split "
                f"must fall on its {block}-value blocks. Choose a tensor_parallel_size that "
                f"divides {self.shape[1] // block} blocks, or load with quantization='none'."
            )
        blocks = self.raw.view(self.shape[0], -1, size)
        part = blocks.narrow(1, start // block, length // block).reshape(self.shape[0], -1)
        return GGUFTensor(part.contiguous(), self.qtype, (self.shape[0], length))

    def pad_rows(self, rows: int) -> GGUFTensor:
        """All-zero blocks dequantize to zero rows."""
        if rows == self.shape[0]:
            return self
        pad = self.raw.new_zeros(rows - self.shape[0], self.raw.shape[1])
        return GGUFTensor(torch.cat([self.raw, pad]), self.qtype, (rows, self.shape[1]))

    def load_into(self, param: torch.nn.Parameter, out_offset: int = 0) -> None:
        load_quantized(param, self, out_offset)

    def dequantize(self, rows: torch.Tensor | None = None, lib=None) -> torch.Tensor:
        """Float32 [rows, in_features]: all rows, or those indexed by ``rows``; ``lib``: the
        kernel library that packed them, if the caller holds it (no lookup per call)."""
        if self.packed:
            n, k = self.shape
            return gguf_kernels.dequantize_packed(self.raw, self.qtype, n, k, rows, lib)
        return gguf_kernels.dequantize(self.raw.contiguous(), self.qtype, self.shape[1], rows)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [m, in_features] float32 @ W^T."""
        if self.packed:
            n, k = self.shape
            return gguf_kernels.matmul_packed(x, self.raw, self.qtype, n, k)
        if _use_f32_kernel():
            return gguf_kernels.matmul_f32(x, self.raw, self.qtype, self.shape[1])
        # not prepared after loading (a layer used on its own): pack for this call
        n, k = self.shape
        packed = gguf_kernels.pack(self.raw.contiguous(), self.qtype, k)
        return gguf_kernels.matmul_packed(x, packed, self.qtype, n, k)


def gguf_kernels_type_name(qtype: int) -> str:
    names = {v: k for k, v in gguf_kernels.SUPPORTED_TYPES.items()}
    return names.get(qtype, str(qtype))


@dataclass
class GGUFWeight(QuantizedWeight):
    """A layer's quantized weight: segments of output rows, each in one GGML type."""

    in_features: int
    out_features: int
    # (first output row, GGUFTensor), in row order once complete
    segments: list[tuple[int, GGUFTensor]] = field(default_factory=list)
    # Once packed: the kernel and its per-segment arguments (type, weight address, rows,
    # first row), so that a forward is one ctypes call per segment and no other Python.
    packed_calls: list[tuple[int, int, int, int]] | None = None
    kernel: Any = None
    lib: Any = None  # the kernel library that packed the segments (row lookups call it)
    # Shards held dense beside the blocks: (first output row, float32 [rows, in_features]).
    dense: list[tuple[int, torch.Tensor]] = field(default_factory=list)

    def add(self, offset: int, tensor: GGUFTensor) -> None:
        self.segments.append(
            (offset, GGUFTensor(tensor.raw.contiguous(), tensor.qtype, tensor.shape))
        )
        self.segments.sort(key=lambda s: s[0])

    @property
    def nbytes(self) -> int:
        dense = sum(w.numel() * w.element_size() for _, w in self.dense)
        return dense + sum(t.raw.numel() for _, t in self.segments)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Dequantized rows ``index`` (an embedding lookup), float32 [*index.shape, in]."""
        if len(self.segments) != 1 or self.dense:
            raise NotImplementedError("row lookups of a fused quantized weight")
        flat = self.segments[0][1].dequantize(index, self.lib)
        return flat.reshape(*index.shape, self.in_features)

    def prepare_for_int8_kernels(self) -> None:
        """Once after loading: merge neighbouring segments of one type (one kernel call for
        q/k/v) and repack them for ``gguf_kernels.matmul_packed``. Idempotent (a tied LM head
        and its embedding share the weight)."""
        merged: list[tuple[int, GGUFTensor]] = []
        for offset, tensor in self.segments:
            if merged and not tensor.packed and merged[-1][1].qtype == tensor.qtype:
                first, prev = merged[-1]
                if not prev.packed and first + prev.shape[0] == offset:
                    rows = prev.shape[0] + tensor.shape[0]
                    raw = gguf_kernels.anonymous_bytes(prev.raw.numel() + tensor.raw.numel())
                    raw = torch.cat([prev.raw, tensor.raw], out=raw.view(rows, -1))
                    merged[-1] = (first, GGUFTensor(raw, tensor.qtype, (rows, self.in_features)))
                    continue
            merged.append((offset, tensor))
        self.segments = []
        for offset, tensor in merged:
            if not tensor.packed:
                raw = gguf_kernels.pack(tensor.raw, tensor.qtype, self.in_features)
                tensor = GGUFTensor(raw, tensor.qtype, tensor.shape, packed=True)
            self.segments.append((offset, tensor))
        self.packed_calls = [
            (t.qtype, t.raw.data_ptr(), t.shape[0], offset) for offset, t in self.segments
        ]
        self.kernel = gguf_kernels.packed_matmul_kernel()
        self.lib = gguf_kernels.load_gguf_kernels()


def packed_experts(
    gate_up: list[GGUFWeight | None], down: list[GGUFWeight | None], **extras
) -> gguf_kernels.PackedExperts | None:
    """Every expert's weights as ``gguf_kernels.moe_forward`` takes them, or None unless all
    are packed with the same segments (a file's stacked tensors are: one type each).
    extras: PackedExperts' biases and gating (gpt-oss)."""
    gate_up_segments, down_segments = _packed_segments(gate_up), _packed_segments(down)
    if gate_up_segments is None or down_segments is None:
        return None
    return gguf_kernels.PackedExperts(gate_up_segments, down_segments, **extras)


def _packed_segments(weights: list[GGUFWeight | None]) -> gguf_kernels.PackedSegments | None:
    """One weight of every expert, or None unless all are packed alike."""
    first = weights[0]
    if first is None or first.packed_calls is None:
        return None
    layout = [(qtype, rows, offset) for qtype, _, rows, offset in first.packed_calls]
    addresses = []
    for w in weights:
        if w is None or w.packed_calls is None or w.dense or w.in_features != first.in_features:
            return None
        if [(qtype, rows, offset) for qtype, _, rows, offset in w.packed_calls] != layout:
            return None
        addresses += [ptr for _, ptr, _, _ in w.packed_calls]
    types, rows, offsets = (torch.tensor(column, dtype=torch.int64) for column in zip(*layout))
    return gguf_kernels.PackedSegments(
        types,
        rows,
        offsets,
        torch.tensor(addresses, dtype=torch.int64),
        first.in_features,
        tuple(t.raw for w in weights for _, t in w.segments),
    )


def _use_f32_kernel() -> bool:
    return envs.MINIVLLM_GGUF_KERNEL == "f32"


def matmul(weight: GGUFWeight, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] @ W^T (+ bias), float32."""
    if weight.packed_calls is not None:
        return _matmul_packed(weight, x, bias)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).float()
    y = torch.empty(x2.shape[0], weight.out_features)
    for offset, t in weight.segments:
        y[:, offset : offset + t.shape[0]] = t.matmul(x2)
    _matmul_dense(weight, x2, y)
    if bias is not None:
        y = y + bias
    return y.reshape(*shape[:-1], y.shape[-1])


def _matmul_packed(weight: GGUFWeight, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The hot path (every linear layer of a forward): each segment's kernel writes its
    columns of one output."""
    shape = x.shape
    k, n = weight.in_features, weight.out_features
    x2 = x.reshape(-1, k)
    if x2.dtype != torch.float32 or not x2.is_contiguous():
        x2 = x2.float().contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n)
    if m:
        xp, yp = x2.data_ptr(), y.data_ptr()
        for qtype, ptr, rows, offset in weight.packed_calls:
            cpu_kernels.launch(
                weight.kernel, qtype, ptr, rows, k, xp, m, yp + 4 * offset, n, checked=True
            )
        _matmul_dense(weight, x2, y)
    if bias is not None:
        y += bias
    return y.view(*shape[:-1], n)


def _matmul_dense(weight: GGUFWeight, x2: torch.Tensor, y: torch.Tensor) -> None:
    """The dense shards' columns of y (through ``out=`` and a copy, which a CPU graph
    captures)."""
    for offset, w in weight.dense:
        part = torch.empty(x2.shape[0], w.shape[0])
        torch.mm(x2, w.t(), out=part)
        y[:, offset : offset + w.shape[0]].copy_(part)


def load_quantized(param: torch.nn.Parameter, tensor: GGUFTensor, out_offset: int = 0) -> None:
    """Keep ``tensor`` (already cut to this rank's rows and columns) as rows
    [out_offset, out_offset + rows) of ``param``'s quantized weight."""
    rows, cols = tensor.shape
    weight = quantized_weight(param)
    out_features, in_features = (
        (weight.out_features, weight.in_features) if weight is not None else param.shape
    )
    if cols != in_features or out_offset + rows > out_features:
        raise ValueError(
            f"shape mismatch: parameter {(out_features, in_features)}, "
            f"checkpoint rows {rows} x {cols}"
        )
    if weight is None:
        weight = GGUFWeight(in_features=in_features, out_features=out_features)
        # shards copied in dense before the first blocks came (see load_shard)
        for offset, rows in getattr(param, "dense_rows", ()):
            weight.dense.append((offset, param.data.narrow(0, offset, rows).float().clone()))
        param.quantized = weight
        param.data = torch.empty(0)  # the float storage is never used (nor touched)
    weight.add(out_offset, tensor)


def load_shard(
    param: torch.nn.Parameter, tensor: GGUFTensor | torch.Tensor, out_offset: int
) -> None:
    """One shard of a fused weight (q, k or v; gate or up), already cut to this rank's rows,
    as rows [out_offset, out_offset + rows): blocks, or a dense tensor. Shards of one layer
    may come either way and in any order; while none has come as blocks the dense ones
    fill the float weight, and once one has they are dense segments beside the blocks."""
    if isinstance(tensor, GGUFTensor):
        load_quantized(param, tensor, out_offset)
        return
    rows = tensor.shape[0]
    weight = quantized_weight(param)
    if weight is not None:
        weight.dense.append((out_offset, tensor.float().contiguous()))
        return
    param.data.narrow(0, out_offset, rows).copy_(tensor)
    param.dense_rows = [*getattr(param, "dense_rows", ()), (out_offset, rows)]


class GGUFLinearMethod(LinearMethodBase):
    """A layer whose weight the loader hands over as GGUF blocks (``load_quantized``)."""

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ) -> None:
        # A float placeholder (never touched): the file may hold this tensor unquantized, and
        # load_quantized drops its storage when blocks arrive.
        create_dense_weight(
            layer,
            input_size_per_partition,
            output_partition_sizes,
            params_dtype,
            extra_weight_attrs,
        )

    def load_shard(
        self, layer: nn.Module, loaded: torch.Tensor | QuantizedTensor, out_offset: int
    ) -> None:
        # blocks, or a shard the file holds dense beside blocks (see load_shard)
        load_shard(layer.weight, loaded, out_offset)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight = quantized_weight(layer.weight)
        if weight is None:  # stored unquantized in the file: dense
            layer.quant_method = UnquantizedLinearMethod()
            layer.quant_method.process_weights_after_loading(layer)
        elif not _use_f32_kernel():
            weight.prepare_for_int8_kernels()

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return matmul(layer.weight.quantized, x, bias)


class GGUFConfig(QuantizationConfig):
    """``quantization="gguf"``: linear layers and the LM head keep their GGUF blocks (the
    embedding dequantizes the rows it gathers by itself)."""

    def get_name(self) -> str:
        return "gguf"

    def get_quant_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        return GGUFLinearMethod() if isinstance(layer, UsesLinearMethod) else None

    def mxfp4_matrix(self, blocks: torch.Tensor, scales: torch.Tensor) -> GGUFTensor:
        """Kept as GGUF's MXFP4 blocks, which the kernels multiply."""
        raw = mxfp4_as_gguf_blocks(blocks, scales).contiguous()
        return GGUFTensor(raw, MXFP4, (raw.shape[0], blocks.shape[-2] * 32))


MXFP4 = gguf_kernels.SUPPORTED_TYPES["MXFP4"]
