"""The Triton small-M product (a decode step's rows by a half-precision weight) against a
float64 reference: one rounding of an fp32 sum, whether K is split or not. Under the
interpreter on CPU tensors in CI, compiled on CUDA with a GPU (as test_triton_layers.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from minivllm.kernels import triton_linear  # noqa: E402

from .test_triton_attention import DEVICES  # noqa: E402


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "m, n, k, splits",
    [
        (1, 40, 300, 1),  # tails in N and K; too short a K to split
        (3, 48, 1024, 2),  # few programs: K in two fp32 partial sums, added by a second kernel
        (16, 96, 2048, 4),
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_small_m_linear_is_one_rounding_of_the_exact_product(device, m, n, k, splits, dtype):
    assert triton_linear.split_k(n, k) == splits
    torch.manual_seed(0)
    x = torch.randn(m, k, device=device).to(dtype)
    weight = (torch.randn(n, k, device=device) / k**0.5).to(dtype)
    bias = torch.randn(n, device=device).to(dtype)
    assert triton_linear.supports(x, weight)
    exact = x.double() @ weight.double().T
    got = triton_linear.small_m_linear(x, weight)
    assert got.shape == (m, n) and got.dtype == dtype
    # fp32 sums in another order, then one rounding (the interpreter truncates its casts).
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    torch.testing.assert_close(got.double(), exact, rtol=ulp, atol=1e-3)
    with_bias = triton_linear.small_m_linear(x, weight, bias)
    torch.testing.assert_close(with_bias.double(), exact + bias.double(), rtol=2 * ulp, atol=2e-2)


def test_what_it_takes():
    w = torch.zeros(32, 64, dtype=torch.bfloat16)
    assert triton_linear.supports(torch.zeros(16, 64, dtype=torch.bfloat16), w)
    assert not triton_linear.supports(torch.zeros(17, 64, dtype=torch.bfloat16), w)  # a prompt
    assert not triton_linear.supports(torch.zeros(1, 64), w.float())  # tl.dot would take TF32
    assert not triton_linear.supports(torch.zeros(1, 64, dtype=torch.bfloat16), w.T)  # strided
    # The card's worth of programs: a narrow product splits K, a wide one does not.
    assert triton_linear.split_k(1024, 3072) == 4  # Qwen3-0.6B's down: 64 slabs x 4
    assert triton_linear.split_k(6144, 1024) == 1  # its gate_up: 384 slabs
