"""The C small-batch linear kernel against F.linear (the layer that dispatches to it:
tests/model/layers/quantization/test_base.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minivllm.kernels.cpu_kernels import load_kernels, small_m_linear
from minivllm.model.layers.quantization.base import SMALL_BATCH_ROWS

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
