"""The seam between a layer and the format of its weight, as vLLM draws it.

A ``QuantizationConfig`` (from the model config's ``quantization``) picks a
``LinearMethodBase`` for each layer that multiplies by a weight (a ``UsesLinearMethod``:
the linear layers, the LM head) (``get_quant_method(layer, prefix)``); without one, or
where it answers None, the layer is dense (``UnquantizedLinearMethod``). The method
creates the layer's weight, loads this rank's part of a checkpoint tensor into it
(``load_weight``, ``load_shard``), may rework it once after loading
(``process_weights_after_loading``), and multiplies by it (``apply``). Each layer holds
its own method instance, so state derived after loading (a packed copy) lives on it.

A format whose checkpoint tensors stay quantized hands them over as ``QuantizedTensor``s
(GGUF's blocks); the layers cut them (rows, columns) as they cut dense tensors, without
knowing the format, and the tensor keeps itself as the parameter's ``QuantizedWeight``
(``param.quantized``, the parameter's float storage dropped).

Dense weights, where the platform says so (``packs_dense_linear_weights``: float32 on the
CPU): ``UnquantizedLinearMethod`` hands each weight to oneDNN in its blocked layout once,
after loading; its GEMM runs decode-shaped products 15-40% faster than ``F.linear`` (MKL)
here, and the 49,152-row LM head nearly 2x faster (MINIVLLM_CPU_PACKED_LINEAR=0 keeps
plain ``F.linear``). Batches of at most SMALL_BATCH_ROWS rows (decoding one or many
sequences) go to the C kernel ``panel_linear`` instead, on a second copy packed in panels
of 16 outputs: 1.1-1.3x oneDNN up to 64 rows, as fast up to 128 (cpu_kernels.c). The plain
weight is dropped (MINIVLLM_CPU_SMALL_BATCH_LINEAR=0 turns the kernel off and packs no
panels); a tied embedding then gathers its rows from the panels (or keeps the plain weight
when there are none).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from minivllm import envs, kernels
from minivllm.kernels.cpu_kernels import load_kernels, pack_panels, panel_linear
from minivllm.platforms import get_platform

# oneDNN picks its blocking for a batch size; decode batches of this order are the hot path.
_PACKING_BATCH_HINT = 256

SMALL_BATCH_ROWS = 128  # up to here the C kernel beats or matches oneDNN on this machine


class QuantizedTensor(ABC):
    """A checkpoint tensor its format keeps quantized: [rows, in_features] as dequantized."""

    shape: tuple[int, int]

    @abstractmethod
    def narrow(self, dim: int, start: int, length: int) -> QuantizedTensor:
        """Rows (dim 0) or input columns (dim 1) [start, start + length)."""

    @abstractmethod
    def pad_rows(self, rows: int) -> QuantizedTensor:
        """Grown to ``rows`` rows with rows that dequantize to zero."""

    @abstractmethod
    def dequantize(self) -> torch.Tensor:
        """Float32 [rows, in_features]."""

    @abstractmethod
    def load_into(self, param: nn.Parameter, out_offset: int = 0) -> None:
        """Keep it (already this rank's part) as rows [out_offset, out_offset + rows) of
        ``param``'s quantized weight (``param.quantized``)."""


class QuantizedWeight(ABC):
    """A parameter's weight held in its format (``param.quantized``)."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes held."""

    @abstractmethod
    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Dequantized rows ``index`` (an embedding lookup), float32 [*index.shape, in]."""


def quantized_weight(param: nn.Parameter | None) -> QuantizedWeight | None:
    return getattr(param, "quantized", None) if param is not None else None


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor | QuantizedTensor) -> None:
    """The whole checkpoint tensor into ``param``: copied, or kept in its format."""
    if isinstance(loaded, QuantizedTensor):
        loaded.load_into(param)
        return
    if param.shape != loaded.shape:
        raise ValueError(
            f"shape mismatch: parameter {tuple(param.shape)}, checkpoint {tuple(loaded.shape)}"
        )
    param.data.copy_(loaded)


class UsesLinearMethod:
    """A layer that multiplies by its weight through a ``LinearMethodBase`` (the linear
    layers, the LM head): the layers a ``QuantizationConfig`` gives a method."""


class LinearMethodBase(ABC):
    """How one layer keeps, loads and multiplies its weight (vLLM's ``LinearMethodBase``)."""

    @abstractmethod
    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        """Register ``layer.weight`` for this rank's partition (output rows: the sum of
        ``output_partition_sizes``, one per fused projection); ``extra_weight_attrs``
        (``weight_loader``) are set on it."""

    def load_weight(
        self, layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor | QuantizedTensor
    ) -> None:
        """This rank's part of a checkpoint tensor (already cut) into ``param``, the
        layer's weight or bias."""
        default_weight_loader(param, loaded)

    def load_shard(
        self, layer: nn.Module, loaded: torch.Tensor | QuantizedTensor, out_offset: int
    ) -> None:
        """One shard of a fused weight (q, k or v; gate or up), this rank's rows, as rows
        [out_offset, out_offset + rows) of ``layer.weight``."""
        if isinstance(loaded, QuantizedTensor):
            loaded = loaded.dequantize()
        layer.weight.data.narrow(0, out_offset, loaded.shape[0]).copy_(loaded)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Rework the loaded weight once, before the first forward (default: nothing)."""
        return None

    def extra_bytes(self) -> int:
        """Bytes this method keeps beside the layer's parameters (packed copies)."""
        return 0

    @abstractmethod
    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [..., in] @ W^T (+ bias)."""


class QuantizationConfig(ABC):
    """A weight format: which method each layer gets (vLLM's ``QuantizationConfig``)."""

    @abstractmethod
    def get_name(self) -> str:
        """The name ``quantization=`` takes for this format."""

    @abstractmethod
    def get_quant_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        """The method for ``layer`` (named ``prefix`` in the model), or None: dense."""

    def mxfp4_matrix(self, blocks: torch.Tensor, scales: torch.Tensor) -> QuantizedTensor | None:
        """An MXFP4 checkpoint matrix (mxfp4.py's layout) kept in this format, or None:
        the loader dequantizes it."""
        return None

    def embedding_table(self, table: torch.Tensor) -> QuantizedTensor | None:
        """A float embedding table [vocab, hidden] as the embedding should keep it in this
        format (it gathers rows from it), or None: float. A format whose checkpoint is
        already quantized hands the table over as it is stored instead."""
        return None


def linear_method_for(
    quant_config: QuantizationConfig | None, layer: nn.Module, prefix: str
) -> LinearMethodBase:
    """The method ``quant_config`` picks for ``layer``; dense when it picks none."""
    method = quant_config.get_quant_method(layer, prefix) if quant_config is not None else None
    return method if method is not None else UnquantizedLinearMethod()


def create_dense_weight(
    layer: nn.Module,
    input_size_per_partition: int,
    output_partition_sizes: list[int],
    params_dtype: torch.dtype,
    extra_weight_attrs: dict[str, Any],
) -> None:
    """Register ``layer.weight``, float [sum(output_partition_sizes), input_size_per_partition]
    (allocated, not touched: the loader fills it)."""
    rows = sum(output_partition_sizes)
    weight = nn.Parameter(
        torch.empty(rows, input_size_per_partition, dtype=params_dtype), requires_grad=False
    )
    for name, value in extra_weight_attrs.items():
        setattr(weight, name, value)
    layer.register_parameter("weight", weight)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """The weight [out, in] reordered for oneDNN's GEMM (an opaque tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACKING_BATCH_HINT)


class UnquantizedLinearMethod(LinearMethodBase):
    """Dense weights: ``F.linear``, or on the CPU oneDNN's GEMM on a packed copy and the
    small-batch C kernel on panels (see the module's docstring)."""

    def __init__(self) -> None:
        self.packed_weight: torch.Tensor | None = None  # set after loading
        self.small_batch_kernel = None
        self.panels: torch.Tensor | None = None  # [ceil(N / 16), K, 16], for the kernel
        self.out_features = 0
        # A decode step's few rows by Triton's product on a GPU (opt-in until measured).
        self.small_m_kernel = envs.MINIVLLM_TRITON_SMALL_M_LINEAR

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        create_dense_weight(
            layer,
            input_size_per_partition,
            output_partition_sizes,
            params_dtype,
            extra_weight_attrs,
        )

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Pack the weight for oneDNN, and in panels for the small-batch kernel, then drop
        the plain copy. A weight another module
        shares (``layer.weight_is_shared``: an LM head tied to the embedding) is left to it
        as the panels (``weight.panels``: the embedding gathers its rows there), or plain
        when there are none."""
        weight = layer.weight
        if not get_platform(weight.device.type).packs_dense_linear_weights(weight.dtype):
            return
        self.packed_weight = pack_weight(weight)
        self.out_features = weight.shape[0]
        self.small_batch_kernel = load_kernels("MINIVLLM_CPU_SMALL_BATCH_LINEAR")
        if self.small_batch_kernel is not None:
            self.panels = pack_panels(weight)
        if getattr(layer, "weight_is_shared", False):
            if self.panels is None:
                return
            weight.panels = self.panels
        weight.data = torch.empty(0)  # memory: only the packed copies are used now

    def extra_bytes(self) -> int:
        copies = (self.packed_weight, self.panels)
        return sum(c.numel() * c.element_size() for c in copies if c is not None)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        packed = self.packed_weight
        if packed is None:
            if (
                self.small_m_kernel
                and (gpu := kernels.triton_linear_for(x)) is not None
                and gpu.supports(x, layer.weight)
            ):
                return gpu.small_m_linear(x, layer.weight, bias)
            return F.linear(x, layer.weight, bias)
        if self.panels is not None and x.dim() == 2 and x.shape[0] <= SMALL_BATCH_ROWS:
            return panel_linear(self.small_batch_kernel, x, self.panels, self.out_features, bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every weight the model holds: dense parameters, quantized weights, and the
    copies a method keeps for its kernels (oneDNN's layout, panels)."""
    seen: set[int] = set()
    total = 0
    for param in model.parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        total += param.numel() * param.element_size()
        q = quantized_weight(param)
        if q is not None:
            total += q.nbytes
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            total += method.extra_bytes()
    return total
