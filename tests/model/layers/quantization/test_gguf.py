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


def test_int8_path_merges_shards_of_one_type_and_repacks_them():
    from minivllm.model.layers.linear import MergedColumnParallelLinear

    shards = [("Q4_1", 48), ("Q4_1", 16), ("Q6_K", 32)]  # q, k: packed together; v: apart
    k = 256
    raws = [
        torch.from_numpy(random_blocks(name, rows, k, i)) for i, (name, rows) in enumerate(shards)
    ]
    dense = torch.cat(
        [gk.dequantize(r, gk.SUPPORTED_TYPES[n], k) for r, (n, _) in zip(raws, shards)]
    )
    layer = MergedColumnParallelLinear(
        k, {i: rows for i, (_, rows) in enumerate(shards)}, quant_config=GGUFConfig()
    )
    for i, (raw, (name, rows)) in enumerate(zip(raws, shards)):
        tensor = GGUFTensor(raw, gk.SUPPORTED_TYPES[name], (rows, k))
        layer.weight.weight_loader(layer.weight, tensor, i)
    process_weights_after_loading(layer)
    segments = layer.weight.quantized.segments
    assert [(offset, t.qtype, t.packed, t.shape[0]) for offset, t in segments] == [
        (0, gk.SUPPORTED_TYPES["Q4_1"], True, 64),
        (64, gk.SUPPORTED_TYPES["Q6_K"], True, 32),
    ]
    # Both repacked at the file's size (Q6_K: a nibble and a high-bit plane, its scale bytes)
    assert layer.weight.quantized.nbytes == sum(raw.numel() for raw in raws)
    x = torch.randn(3, k)
    expected = F.linear(x, dense)
    err = (layer(x) - expected).abs().max() / expected.abs().max()
    assert err < 0.03  # int8 activations
