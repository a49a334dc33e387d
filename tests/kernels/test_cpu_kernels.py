"""The C small-batch linear kernel and the CPU linear dispatch against F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minivllm.kernels.cpu_kernels import load_kernels, small_m_linear
from minivllm.model.layers.linear import SMALL_BATCH_ROWS, Linear, pack_weights_for_cpu

SWITCH = "MINIVLLM_CPU_SMALL_BATCH_LINEAR"
pytestmark = pytest.mark.skipif(load_kernels(SWITCH) is None, reason="no C compiler")


@pytest.mark.parametrize("k", [576, 40, 7])  # whole 32-wide chunks, a tail, only a tail
@pytest.mark.parametrize("with_bias", [False, True])
def test_small_m_linear_matches_f_linear(k, with_bias):
    g = torch.Generator().manual_seed(k)
    weight = torch.randn(37, k, generator=g)
    bias = torch.randn(37, generator=g) if with_bias else None
    for m in range(1, SMALL_BATCH_ROWS + 1):
        x = torch.randn(m, k, generator=g)
        expected = F.linear(x, weight, bias)
        got = small_m_linear(load_kernels(SWITCH), x, weight, bias)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("small_batch_kernel", ["1", "0"])
def test_packed_layer_matches_f_linear_at_every_batch_size(monkeypatch, small_batch_kernel):
    monkeypatch.setenv(SWITCH, small_batch_kernel)
    layer = Linear(96, 80, bias=True)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    pack_weights_for_cpu(layer)
    assert (layer.small_batch_kernel is not None) == (small_batch_kernel == "1")
    for m in (1, 2, SMALL_BATCH_ROWS, SMALL_BATCH_ROWS + 1, 64):
        x = torch.randn(m, 96)
        torch.testing.assert_close(layer(x), F.linear(x, weight, bias), atol=1e-4, rtol=1e-5)
