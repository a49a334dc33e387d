"""Online quantization (``quantization="q8_0"``, ``"q4_0"``, ...): a float checkpoint (an HF
directory in bfloat16 or float32, or a float GGUF) quantized at load into GGUF blocks, which
then run as a GGUF file's of that type (``quantization="gguf"``): the same packed layout,
int8 kernels and memory (q8_0 adds a second pass over one block a row, below).

``OnlineQuantConfig`` gives every linear layer and the LM head an ``OnlineQuantLinearMethod``:
a ``GGUFLinearMethod`` that makes its blocks itself. A linear layer quantizes each tensor as
it loads (this rank's part of one checkpoint tensor, a fused layer's shards one by one), so
the float checkpoint is never held whole. The embedding table is quantized as it loads too
(``embedding_table``), where the model hands the embedding its quant_config (the Llama
family, Gemma 3 and 4, OPT); a tied LM head then multiplies by those blocks, and an untied one, or
a tied one whose embedding kept its table float, is quantized once after loading. The
blocks are gguf's reference quantizers' (``gguf.quants``: llama.cpp's rounding, bit for bit;
numpy on one core, 75-100 million weights a second here, faster than the same operations in
torch: 1.5 s for the bundled model, a minute for a 4B one), so a checkpoint served with
``q8_0`` holds the blocks of the same weights converted to a Q8_0 GGUF file (and, but for
the refined blocks below, gives its outputs).

``q8_0`` refines its activations where they cost the most: each activation row's 32-value
block of largest max|x| gets a second int8 pass (``gguf_kernels.packed_matmul_kernel(
refined=True)``). The residual stream's few outlier channels (SmolLM2's channel 199 at 40x
the median) make their block's int8 step 20-40x its neighbours' and that block hold 40-76%
of a layer input's rounding error; int8 activations cost the bundled model +0.41%
perplexity against the Q8_0 weights' own +0.12%; with the second pass over that block (1/18 of
a 576-wide layer's work) +0.27% (BENCHMARKS.md, "q8_0's outlier blocks refined").
A Q8_0 GGUF file runs without it, as llama.cpp does; the 4- and 5-bit modes too, whose
weights' error dominates.

What stays float, as llama.cpp's converter leaves it: vectors (norms, biases), MoE routers
(``ffn_gate_inp``), and a layer whose input width is not a whole number of blocks. With 4-
and 5-bit types the LM head and the embedding table are Q8_0 (llama.cpp gives the head
Q6_K, or Q8_0 where a row is not whole 256-value blocks, as on SmolLM2, whose tied table is
its head): the head's error costs more than the other matrices', and the table's memory
is not read per token.
"""

from __future__ import annotations

import torch
from torch import nn

from minivllm.kernels import gguf_kernels
from minivllm.model.layers.quantization.base import (
    LinearMethodBase,
    QuantizationConfig,
    QuantizedTensor,
    UsesLinearMethod,
    default_weight_loader,
    quantized_weight,
)
from minivllm.model.layers.quantization.gguf import GGUFLinearMethod, GGUFTensor, load_quantized

# quantization= name -> the GGML type its matrices are quantized to (gguf.quants has a
# reference quantizer for each, and the int8 kernels multiply each).
ONLINE_TYPES = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1", "q5_0": "Q5_0", "q5_1": "Q5_1"}
# Modes whose products refine each activation row's costliest block (see the docstring).
REFINED_MODES = ("q8_0",)
# The LM head's and the embedding table's type (see the module's docstring).
HEAD_TYPE = "Q8_0"
# A layer named so is a mixture of experts' router: kept float, as llama.cpp keeps it.
_ROUTER_NAMES = ("gate", "router", "shared_expert_gate")


def quantize_matrix(weight: torch.Tensor, type_name: str) -> GGUFTensor:
    """A float matrix [rows, in_features] as GGUF blocks of ``type_name`` (gguf's reference
    quantizer), in memory of their own (freed to the system once the layer repacks them)."""
    import gguf

    rows, cols = weight.shape
    array = weight.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy()
    blocks = gguf.quants.quantize(array, gguf.GGMLQuantizationType[type_name])
    raw = gguf_kernels.anonymous_bytes(blocks.size).view(rows, -1)
    raw.copy_(torch.from_numpy(blocks).view(rows, -1))
    return GGUFTensor(raw, gguf_kernels.SUPPORTED_TYPES[type_name], (rows, cols))


def block_size(type_name: str) -> int:
    return gguf_kernels.BLOCK_SIZES[gguf_kernels.SUPPORTED_TYPES[type_name]][0]


class OnlineQuantLinearMethod(GGUFLinearMethod):
    """A layer whose float weight is quantized to ``type_name`` blocks as it loads (the LM
    head's: after loading), then kept and multiplied as a GGUF file's."""

    def __init__(self, type_name: str, refine: bool = False) -> None:
        self.type_name = type_name
        self.refine = refine

    def _quantizes(self, in_features: int) -> bool:
        return in_features % block_size(self.type_name) == 0

    def load_weight(
        self, layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor | QuantizedTensor
    ) -> None:
        if param is layer.weight and isinstance(loaded, torch.Tensor) and loaded.dim() == 2:
            if self._quantizes(loaded.shape[1]):
                loaded = quantize_matrix(loaded, self.type_name)
        default_weight_loader(param, loaded)

    def load_shard(
        self, layer: nn.Module, loaded: torch.Tensor | QuantizedTensor, out_offset: int
    ) -> None:
        if isinstance(loaded, torch.Tensor) and self._quantizes(loaded.shape[1]):
            loaded = quantize_matrix(loaded, self.type_name)
        super().load_shard(layer, loaded, out_offset)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight = layer.weight
        # The LM head: its (or the tied embedding's) loader filled the float weight.
        if quantized_weight(weight) is None and weight.dim() == 2 and weight.numel():
            if self._quantizes(weight.shape[1]):
                load_quantized(weight, quantize_matrix(weight.data, self.type_name))
        super().process_weights_after_loading(layer)
        quantized = quantized_weight(layer.weight)
        if self.refine and quantized is not None and quantized.packed_calls is not None:
            if all(gguf_kernels.refines(qtype) for qtype, *_ in quantized.packed_calls):
                quantized.kernel = gguf_kernels.packed_matmul_kernel(refined=True)


class OnlineQuantConfig(QuantizationConfig):
    """``quantization=`` one of ``ONLINE_TYPES``: linear layers (routers aside) and the LM
    head quantized at load to that GGUF type."""

    def __init__(self, name: str) -> None:
        if name not in ONLINE_TYPES:
            raise ValueError(f"unknown online quantization {name!r}; known: {list(ONLINE_TYPES)}")
        self.name = name

    def get_name(self) -> str:
        return self.name

    def get_quant_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        if not isinstance(layer, UsesLinearMethod):
            return None
        last = prefix.rsplit(".", 1)[-1]
        if last in _ROUTER_NAMES:
            return None
        refine = self.name in REFINED_MODES
        if last == "lm_head":
            return OnlineQuantLinearMethod(HEAD_TYPE, refine)
        return OnlineQuantLinearMethod(ONLINE_TYPES[self.name], refine)

    def embedding_table(self, table: torch.Tensor) -> QuantizedTensor | None:
        if table.dim() != 2 or table.shape[1] % block_size(HEAD_TYPE):
            return None
        return quantize_matrix(table, HEAD_TYPE)
