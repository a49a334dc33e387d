"""The GGUF kernels on random blocks of every supported type: float32 unpacking bit-exact
against gguf's numpy dequantization, the int8-activation product close to the product with
the dequantized weights, and the float32 product equal to F.linear on them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from minivllm.kernels import gguf_kernels as gk

pytestmark = pytest.mark.skipif(gk.load_gguf_kernels() is None, reason="no C compiler")

# Byte offsets of each type's float16 scale fields inside a block.
_F16_FIELDS = {
    "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
    "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
}  # fmt: skip
TYPES = sorted(gk.SUPPORTED_TYPES, key=gk.SUPPORTED_TYPES.get)


def random_blocks(name: str, rows: int, k: int, seed: int = 0) -> np.ndarray:
    """Random bytes with finite, moderate float16 scales: [rows, bytes per row] uint8."""
    qtype = gk.SUPPORTED_TYPES[name]
    block, size = gk.BLOCK_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * k // block, size), dtype=np.uint8)
    for at in _F16_FIELDS[name]:
        scale = (rng.standard_normal(blocks.shape[0]) * 0.01).astype(np.float16)
        blocks[:, at : at + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def reference(name: str, raw: np.ndarray) -> np.ndarray:
    return gguf_dequantize(raw, GGMLQuantizationType[name])


@pytest.mark.parametrize("name", TYPES)
def test_unpacking_is_bit_exact_against_gguf(name):
    raw = random_blocks(name, rows=7, k=512)
    got = gk.dequantize(torch.from_numpy(raw), gk.SUPPORTED_TYPES[name], 512).numpy()
    expected = reference(name, raw)
    assert got.shape == expected.shape
    np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("name", ["Q4_1", "Q6_K"])
def test_gathered_rows_are_the_dequantized_rows(name):
    raw = random_blocks(name, rows=20, k=256, seed=1)
    rows = torch.tensor([[3, 19], [0, 3]])
    got = gk.dequantize(torch.from_numpy(raw), gk.SUPPORTED_TYPES[name], 256, rows)
    expected = torch.from_numpy(reference(name, raw))[rows.reshape(-1)]
    assert torch.equal(got, expected)
    with pytest.raises(IndexError):
        gk.dequantize(torch.from_numpy(raw), gk.SUPPORTED_TYPES[name], 256, torch.tensor([20]))


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("m", [1, 3, 64])
def test_int8_product_is_close_to_the_float_product(name, m):
    # n = 21 leaves a partial tile of weight rows; k = 768 is 12 vector chunks (no tail),
    # k = 288 for the 32-blocks leaves a 32-value tail after 4 chunks of 64.
    k = 768 if gk.BLOCK_SIZES[gk.SUPPORTED_TYPES[name]][0] == 256 else 288
    raw = random_blocks(name, rows=21, k=k, seed=m)
    weight = torch.from_numpy(reference(name, raw))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    expected = F.linear(x, weight)
    got = gk.matmul_q8(x, torch.from_numpy(raw), gk.SUPPORTED_TYPES[name], k)
    # int8 activations: ~0.4% of each value's block maximum per value, so relative to the
    # size of the outputs the error stays within a few percent.
    err = (got - expected).abs().max() / expected.abs().max()
    assert err < 0.03, err
    # And it is the exact product with the int8-rounded activations, up to float sums.
    blocks = x.reshape(m, -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / torch.where(d > 0, d, 1), 0)  # as the kernel rounds
    xq = torch.round(blocks * inv) * d
    exact = F.linear(xq.reshape(m, k), weight)
    assert ((got - exact).abs().max() / exact.abs().max()) < 1e-4


@pytest.mark.parametrize("name", ["Q4_0", "Q5_K"])
def test_float32_product_matches_f_linear(name, monkeypatch):
    monkeypatch.setattr(gk, "_F32_TILE_ELEMENTS", 256 * 5)  # several tiles, a partial one
    raw = random_blocks(name, rows=23, k=256, seed=2)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(3))
    got = gk.matmul_f32(x, torch.from_numpy(raw), gk.SUPPORTED_TYPES[name], 256)
    expected = F.linear(x, torch.from_numpy(reference(name, raw)))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)  # GEMM order


def test_shapes_are_checked():
    raw = torch.from_numpy(random_blocks("Q4_0", rows=2, k=64))
    with pytest.raises(ValueError):
        gk.matmul_q8(torch.randn(1, 32), raw, gk.SUPPORTED_TYPES["Q4_0"], 64)
    with pytest.raises(ValueError):
        gk.dequantize(raw, gk.SUPPORTED_TYPES["Q4_K"], 64)


# The packed layout of the integer kernel, on each path this CPU can run: the library built
# for it (AVX-512 VNNI here), then for AVX2 and without either (portable C).
_VARIANTS = {
    "native": (),
    "avx2": ("-mno-avx512f",),
    "portable": ("-mno-avx512f", "-mno-avx2", "-mno-fma"),
}
PACKED_TYPES = [name for name in TYPES if gk.can_pack(gk.SUPPORTED_TYPES[name])]


def variant(name: str):
    if name == "avx2" and "avx2" not in open("/proc/cpuinfo").read():
        pytest.skip("no AVX2 on this CPU")
    lib = gk.load_gguf_kernels(_VARIANTS[name])
    if name != "native":
        assert gk.packed_path(lib) == name
    return lib


def test_packed_types():
    assert PACKED_TYPES == ["Q4_0", "Q4_1", "Q8_0", "Q4_K"]


@pytest.mark.parametrize("name", PACKED_TYPES)
def test_packed_weights_dequantize_as_the_blocks(name):
    qtype = gk.SUPPORTED_TYPES[name]
    raw = random_blocks(name, rows=21, k=512, seed=4)  # 21 rows: a padded second tile
    packed = gk.pack(torch.from_numpy(raw), qtype, 512)
    expected = torch.from_numpy(reference(name, raw))
    got = gk.dequantize_packed(packed, qtype, 21, 512)
    if name == "Q4_K":  # its scales (a float16 times a 6-bit factor) are rounded to float16:
        # s * q + m moves by at most 2^-11 (|s * q| + |m|) <= 2^-11 * 3 * max |w| of the block
        blocks = expected.reshape(21, -1, 32)
        bound = blocks.abs().amax(-1, keepdim=True) * 3 * 2**-11
        assert ((got.reshape(21, -1, 32) - blocks).abs() <= bound).all()
        assert not torch.equal(got, expected)  # (so the bound is what this checks)
    else:  # the file's float16 scales are kept: bit-exact
        assert torch.equal(got, expected)
    rows = torch.tensor([20, 0, 17])
    assert torch.equal(gk.dequantize_packed(packed, qtype, 21, 512, rows), got[rows])


@pytest.mark.parametrize("path", list(_VARIANTS))
@pytest.mark.parametrize("name", PACKED_TYPES)
@pytest.mark.parametrize("m", [1, 6, 70])
def test_packed_product_is_the_product_with_int8_activations(path, name, m):
    lib = variant(path)
    qtype = gk.SUPPORTED_TYPES[name]
    n, k = 37, 512  # 3 tiles of 16 rows, the last partial; m = 6, 70: groups of 4 and 1-3 left
    raw = random_blocks(name, rows=n, k=k, seed=m)
    packed = gk.pack(torch.from_numpy(raw), qtype, k, lib)
    weight = gk.dequantize_packed(packed, qtype, n, k, lib=lib)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3
    blocks = x.reshape(m, -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / torch.where(d > 0, d, 1), 0)
    exact = F.linear((torch.round(blocks * inv) * d).reshape(m, k), weight)
    got = gk.matmul_packed(x, packed, qtype, n, k, lib)
    assert got.shape == (m, n)
    assert ((got - exact).abs().max() / exact.abs().max()) < 1e-5
