"""The Triton layer kernels (RMS norm with the residual add, SiLU-and-mul, rotary) against
the layers' torch code, which follows HF's order of operations and roundings.

Rotary is elementwise with the same roundings as torch, so it must be equal bit for bit
(contraction into FMAs is off at launch); the norm sums in another order and SiLU takes
another exp, so they may differ by a rounding. Under the interpreter on CPU tensors in CI, compiled
on CUDA with a GPU (marked `gpu`), as tests/kernels/test_triton_attention.py.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from minivllm.kernels import triton_layers  # noqa: E402
from minivllm.model.layers.activation import SiluAndMul  # noqa: E402
from minivllm.model.layers.norm import RMSNorm  # noqa: E402
from minivllm.model.layers.rotary import get_rope  # noqa: E402

from .test_triton_attention import DEVICES  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]


def torch_norm(x, weight, eps, residual=None):
    """RMSNorm's torch path (the kernels' own switches off)."""
    norm = RMSNorm(x.shape[-1], eps)
    norm.kernels = None
    norm.weight.data = weight
    return norm._norm(x) if residual is None else norm._norm(x + residual)


def assert_one_rounding_apart(got, want, equal_share: float):
    """Equal but for a last bit (the norm's order of summation, each library's exp): in
    bfloat16, where rounding hides most of them, equal_share of the values are equal."""
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    else:
        torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=2**-7)
        assert (got == want).float().mean() > equal_share


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_and_without_the_residual(device, dtype):
    torch.manual_seed(0)
    x = torch.randn(7, 96, dtype=dtype, device=device) * 3
    residual = torch.randn(7, 96, dtype=dtype, device=device)
    weight = (torch.rand(96, device=device) + 0.5).to(dtype)
    assert_one_rounding_apart(
        triton_layers.rms_norm(x, weight, 1e-6), torch_norm(x, weight, 1e-6), 0.95
    )

    stream = residual.clone()
    out = triton_layers.rms_norm(x, weight, 1e-6, stream)
    assert torch.equal(stream, x + residual)  # the residual stream, updated in place
    assert_one_rounding_apart(out, torch_norm(x, weight, 1e-6, residual), 0.95)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_of_heads_in_the_fused_qkv_rows(device, dtype):
    """Qwen3's q and k norms: per head, on views of the qkv projection's rows."""
    torch.manual_seed(1)
    heads, kv_heads, head_dim = 4, 2, 64
    qkv = torch.randn(5, (heads + 2 * kv_heads) * head_dim, dtype=dtype, device=device)
    q = qkv[:, : heads * head_dim].view(-1, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(-1, kv_heads, head_dim)
    weight = (torch.rand(head_dim, device=device) + 0.5).to(dtype)
    for x in (q, k):
        assert not x.is_contiguous() and triton_layers.takes_rms_norm(x, weight, None)
        out = triton_layers.rms_norm(x, weight, 1e-6)
        assert out.shape == x.shape
        assert_one_rounding_apart(out, torch_norm(x.contiguous(), weight, 1e-6), 0.95)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_equals_torch(device, dtype):
    torch.manual_seed(2)
    x = torch.randn(6, 2 * 1300, dtype=dtype, device=device) * 4  # two column blocks
    act = SiluAndMul()
    act.kernels = None
    assert_one_rounding_apart(triton_layers.silu_and_mul(x), act(x), 0.99)
    rows = torch.randn(6, 2 * 1300 + 8, dtype=dtype, device=device)[:, 8:]  # strided rows
    assert_one_rounding_apart(triton_layers.silu_and_mul(rows), act(rows.contiguous()), 0.99)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 64), (6, 1, 128), (3, 0, 32)])
def test_rotary_in_place_equals_torch(device, dtype, heads, kv_heads, head_dim):
    """q and k as views of the fused qkv rows, turned in place; the llama3 tables (Llama
    3.2's); kv_heads 0: a layer that turns its queries alone (KV sharing)."""
    torch.manual_seed(3)
    params = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}  # fmt: skip
    rope = get_rope(head_dim, 4096, params).to(device)
    rope.kernels = None
    positions = torch.tensor([0, 1, 17, 900, 4095, 3], device=device)
    qkv = torch.randn(6, (heads + 2 * kv_heads) * head_dim, dtype=dtype, device=device) * 2
    q = qkv[:, : heads * head_dim].view(-1, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(6, kv_heads, head_dim)
    want_q, want_k = rope(positions, q.clone(), k.clone())
    cos, sin = rope.cos.to(device), rope.sin.to(device)
    triton_layers.rotary_embedding(positions, q, k, cos, sin)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)


def test_the_platform_decides_which_tensors_take_them():
    """CUDA's platform takes the kernels; a CPU tensor goes on to the torch (or C) path."""
    from minivllm import kernels
    from minivllm.platforms.cpu import CpuPlatform
    from minivllm.platforms.cuda import CudaPlatform

    assert CudaPlatform().runs_triton_layer_kernels()
    assert not CpuPlatform().runs_triton_layer_kernels()
    assert kernels.triton_layers_for(torch.zeros(2)) is None
