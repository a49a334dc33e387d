"""The C small-batch linear kernel against F.linear (the layer that dispatches to it:
tests/model/layers/quantization/test_base.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minivllm.kernels.cpu_kernels import (
    cpu_isa,
    load_kernels,
    load_library,
    pack_panels,
    panel_linear,
)
from minivllm.model.layers.quantization.base import SMALL_BATCH_ROWS

SWITCH = "MINIVLLM_CPU_SMALL_BATCH_LINEAR"
pytestmark = pytest.mark.skipif(load_kernels(SWITCH) is None, reason="no C compiler")


# The kernels' tile shapes are picked per vector width (16 floats with AVX-512, else 8): the
# library built for this CPU's own, and for the other width with -DVL (slow where the CPU
# lacks it, exact). The attention tests take them too. (The width the build is for: this
# CPU's, or the one MINIVLLM_CPU_ISA forces.)
_OTHER_WIDTH = "-DVL=8" if cpu_isa() == "avx512" else "-DVL=16"
WIDTHS = {"native": (), "other width": (_OTHER_WIDTH,)}


@pytest.mark.parametrize("flags", list(WIDTHS.values()), ids=list(WIDTHS))
@pytest.mark.parametrize("k", [576, 40, 7])
@pytest.mark.parametrize("with_bias", [False, True])
# 48: 3 panels, a pair and a lone one; 60: 3 and a partial one; 8: only a partial one; 32:
# one pair alone (a DeltaNet layer's b/a projection), run without a thread team
@pytest.mark.parametrize("n", [48, 60, 8, 32])
def test_panel_linear_matches_f_linear(flags, k, with_bias, n):
    lib = load_library(flags)
    assert lib is not None
    g = torch.Generator().manual_seed(k)
    weight = torch.randn(n, k, generator=g)
    bias = torch.randn(n, generator=g) if with_bias else None
    panels = pack_panels(weight)
    assert panels.shape == (-(-n // 16), k, 16)
    for m in [*range(1, 18), 37, SMALL_BATCH_ROWS]:  # every row-tile size, whole tiles
        x = torch.randn(m, k, generator=g)
        got = panel_linear(lib, x, panels, n, bias)
        torch.testing.assert_close(got, F.linear(x, weight, bias), atol=1e-4, rtol=1e-5)
        # A row's result never depends on the rows beside it.
        assert torch.equal(panel_linear(lib, x[-1:], panels, n, bias), got[-1:])
    with pytest.raises(ValueError, match="do not hold"):
        panel_linear(lib, x, panels, n + 16, bias)


# The layer kernels (MINIVLLM_CPU_LAYER_KERNELS), each through the module that calls it,
# against the same module built with the switch off (torch ops).
LAYER_SWITCH = "MINIVLLM_CPU_LAYER_KERNELS"


def _both(monkeypatch, make):
    """make() built with the layer kernels on, and with them off."""
    monkeypatch.setenv(LAYER_SWITCH, "1")
    fast = make()
    monkeypatch.setenv(LAYER_SWITCH, "0")
    slow = make()
    assert fast.kernels is not None and slow.kernels is None
    return fast, slow


@pytest.mark.parametrize("m", [1, 3, 40])  # one row, a few, enough to split over threads
def test_rms_norm_with_and_without_the_residual(monkeypatch, m):
    from minivllm.model.layers.norm import RMSNorm

    def make():
        norm = RMSNorm(576, 1e-5)
        norm.weight.data = torch.randn(576, generator=torch.Generator().manual_seed(0))
        return norm

    fast, slow = _both(monkeypatch, make)
    g = torch.Generator().manual_seed(m)
    x, residual = torch.randn(m, 576, generator=g) * 3, torch.randn(m, 576, generator=g)
    torch.testing.assert_close(fast(x), slow(x), atol=1e-5, rtol=1e-5)
    expected, expected_sum = slow(x, residual.clone())
    stream = residual.clone()
    got, got_sum = fast(x, stream)
    assert got_sum is stream  # the stream is updated in place, as vLLM's fused op
    assert torch.equal(got_sum, x + residual)  # the add is exact
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_silu_and_mul(monkeypatch):
    from minivllm.model.layers.activation import SiluAndMul

    fast, slow = _both(monkeypatch, SiluAndMul)
    x = torch.randn(5, 2 * 1536, generator=torch.Generator().manual_seed(1)) * 4
    torch.testing.assert_close(fast(x), slow(x), atol=1e-6, rtol=1e-5)


def test_rope_rotates_strided_heads_in_place_bit_for_bit(monkeypatch):
    from minivllm.model.layers.rotary import RotaryEmbedding

    params = {"rope_type": "default", "rope_theta": 10000.0}
    fast, slow = _both(monkeypatch, lambda: RotaryEmbedding(64, 256, params, torch.float32))
    # q and k as the attention layer sees them: views of one fused qkv row per token.
    qkv = torch.randn(7, (9 + 3 + 3) * 64, generator=torch.Generator().manual_seed(2))
    positions = torch.tensor([0, 1, 5, 17, 100, 200, 255])

    def views(t):
        q, k, _ = t.split([9 * 64, 3 * 64, 3 * 64], dim=-1)
        return q.view(7, 9, 64), k.view(7, 3, 64)

    expected_q, expected_k = slow(positions, *views(qkv.clone()))
    rotated = qkv.clone()
    q, k = fast(positions, *views(rotated))
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)
    assert torch.equal(views(rotated)[0], expected_q)  # in place, in the fused buffer
    assert torch.equal(rotated[:, 12 * 64 :], qkv[:, 12 * 64 :])  # v untouched


def test_cache_write_kernel_stores_what_the_torch_path_stores(monkeypatch):
    from minivllm.attention.cpu import CPUAttentionBackend, kv_views, write_kv

    monkeypatch.setenv(LAYER_SWITCH, "1")
    backend = CPUAttentionBackend(block_size=16)
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(5, 2 * 2 * 64, generator=g)  # strided rows, as views of qkv
    k, v = kv[:, :128].view(5, 2, 64), kv[:, 128:].view(5, 2, 64)
    slots = torch.tensor([3, 16, 17, 40, -1])  # the last is padding: skipped
    shape = backend.get_kv_cache_shape(4, 16, 2, 64)
    expected, got = torch.zeros(shape), torch.zeros(shape)
    write_kv(expected, k[:4], v[:4].contiguous(), slots[:4])
    from minivllm.kernels.cpu_kernels import write_kv as kernel_write_kv

    kernel_write_kv(backend.write_kernel, k, v, *kv_views(got), slots)
    assert torch.equal(got, expected)


@pytest.mark.parametrize(
    "m, k, rank, sizes",
    [(1, 576, 16, [576, 192, 192]), (8, 96, 4, [128, 128]), (3, 1536, 8, [576])],
)  # q/k/v, gate/up, down: a fused layer's LoRAs, each in its own rows and rank columns
def test_lora_add_matches_float64(m, k, rank, sizes):
    from minivllm.kernels.cpu_kernels import lora_add

    g = torch.Generator().manual_seed(m)
    slices, n = len(sizes), sum(sizes)
    a = torch.randn(slices * rank, k, generator=g)
    b = torch.zeros(n, slices * rank)
    ends, start = [], 0
    for s, size in enumerate(sizes):
        b[start : start + size, s * rank : (s + 1) * rank] = torch.randn(size, rank, generator=g)
        start += size
        ends.append(start)
    x, out = torch.randn(m, k, generator=g), torch.randn(m, n, generator=g)
    expected = out.double() + (x.double() @ a.double().T) @ b.double().T
    lora_add(load_library(), x, a, b, out, rank, torch.tensor(ends))
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-5)
