"""GGUFLinearMethod: a layer keeps the blocks it was handed; a tensor the file stores
unquantized makes the layer dense after loading (packed like any dense layer)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minivllm.kernels import gguf_kernels as gk
from minivllm.model.layers.linear import Linear
from minivllm.model.layers.quantization.base import UnquantizedLinearMethod
from minivllm.model.layers.quantization.gguf import GGUFConfig, GGUFLinearMethod, GGUFTensor
from minivllm.model.weight_loading import process_weights_after_loading
from tests.kernels.test_gguf_kernels import random_blocks

pytestmark = pytest.mark.skipif(gk.load_gguf_kernels() is None, reason="no C compiler")


def test_blocks_stay_blocks_and_a_dense_tensor_makes_a_dense_layer(monkeypatch):
    monkeypatch.setenv("MINIVLLM_GGUF_KERNEL", "f32")
    raw = torch.from_numpy(random_blocks("Q8_0", 8, 64, 0))
    expected = gk.dequantize(raw, gk.SUPPORTED_TYPES["Q8_0"], 64)
    quantized = Linear(64, 8, quant_config=GGUFConfig())
    quantized.weight.weight_loader(
        quantized.weight, GGUFTensor(raw, gk.SUPPORTED_TYPES["Q8_0"], (8, 64))
    )
    dense = Linear(64, 8, quant_config=GGUFConfig())
    dense.weight.weight_loader(dense.weight, expected.clone())  # an F32 tensor in the file
    for layer in (quantized, dense):
        process_weights_after_loading(layer)
    assert isinstance(quantized.quant_method, GGUFLinearMethod)
    assert quantized.weight.numel() == 0
    assert type(dense.quant_method) is UnquantizedLinearMethod
    assert dense.quant_method.packed_weight is not None
    x = torch.randn(5, 64)
    for layer in (quantized, dense):
        torch.testing.assert_close(layer(x), F.linear(x, expected), atol=1e-4, rtol=1e-4)
