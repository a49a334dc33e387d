"""The GGUF kernels on random blocks of every supported type: float32 unpacking bit-exact
against gguf's numpy dequantization, the float32 product equal to F.linear on them, and the
packed layout of the int8 kernel (on each of its paths): its rows read back as the blocks',
and its product the exact product with the int8-rounded activations."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from minivllm.kernels import cpu_kernels
from minivllm.kernels import gguf_kernels as gk
from minivllm.utils.huge_pages import HUGE_PAGE

pytestmark = pytest.mark.skipif(gk.load_gguf_kernels() is None, reason="no C compiler")

# Byte offsets of each type's float16 scale fields inside a block.
_F16_FIELDS = {
    "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
    "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
    "IQ4_NL": [0], "IQ4_XS": [0], "IQ2_XXS": [0], "IQ2_XS": [0], "IQ2_S": [0],
    "IQ3_XXS": [0], "IQ3_S": [0], "IQ1_S": [0], "IQ1_M": [], "MXFP4": [],
}  # fmt: skip
TYPES = sorted(gk.SUPPORTED_TYPES, key=gk.SUPPORTED_TYPES.get)


def set_iq1_m_d(blocks: np.ndarray, d: np.ndarray) -> None:
    """IQ1_M blocks [count, 56]: their float16 d is the top 4 bits of each of their 4 scale
    words, lowest first."""
    bits = d.astype(np.float16).view(np.uint16)
    words = blocks[:, 48:56].copy().view(np.uint16) & 0x0FFF
    for w in range(4):
        words[:, w] |= ((bits >> (4 * w)) & 0xF) << 12
    blocks[:, 48:56] = words.view(np.uint8)


def random_blocks(name: str, rows: int, k: int, seed: int = 0) -> np.ndarray:
    """Random bytes with finite, moderate float16 scales: [rows, bytes per row] uint8."""
    qtype = gk.SUPPORTED_TYPES[name]
    block, size = gk.BLOCK_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * k // block, size), dtype=np.uint8)
    for at in _F16_FIELDS[name]:
        scale = (rng.standard_normal(blocks.shape[0]) * 0.01).astype(np.float16)
        blocks[:, at : at + 2] = scale.view(np.uint8).reshape(-1, 2)
    if name == "IQ1_M":
        set_iq1_m_d(blocks, rng.standard_normal(blocks.shape[0]) * 0.01)
    if name == "MXFP4":  # an E8M0 exponent byte: scales 2^-12 .. 2^-5
        blocks[:, 0] = rng.integers(116, 124, size=blocks.shape[0], dtype=np.uint8)
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
        gk.matmul_packed(torch.randn(1, 32), raw, gk.SUPPORTED_TYPES["Q4_0"], 2, 64)
    with pytest.raises(ValueError):
        gk.dequantize(raw, gk.SUPPORTED_TYPES["Q4_K"], 64)
    # A type the kernels refuse (F16) is said, not left as an unwritten output.
    packed = gk.pack(raw, gk.SUPPORTED_TYPES["Q4_0"], 64)
    with pytest.raises(ValueError, match="refused"):
        gk.matmul_packed(torch.randn(1, 64), packed, 1, 2, 64)
    with pytest.raises(ValueError, match="refused"):
        gk.dequantize_packed(packed, 1, 2, 64)


# The packed layout of the integer kernel, on each path this CPU can run: the library built
# for it (AVX-512 VNNI here), then for AVX2 and without either (portable C).
_VARIANTS = {
    "native": (),
    "avx2": ("-mno-avx512f",),
    "portable": ("-mno-avx512f", "-mno-avx2", "-mno-fma"),
}


def variant(name: str):
    # The paths at or below the one the build is for (MINIVLLM_CPU_ISA may force it down).
    paths = cpu_kernels.isa_paths()
    if name == "avx2" and "avx2" not in paths[paths.index(cpu_kernels.cpu_isa()) :]:
        pytest.skip("no AVX2 on this CPU, or the kernels are forced below it")
    lib = gk.load_gguf_kernels(_VARIANTS[name])
    if name != "native":
        assert gk.packed_path(lib) == name
    return lib


# Bytes of the packed layout per weight and what the file takes: Q4_K's and Q5_K's float16
# scales per row in place of their 6-bit factors cost a little, and Q3_K's factors a byte
# each in place of 6 bits; the others are at their file's size.
PACKED_RATIO = {"Q3_K": 1.04, "Q4_K": 1.12, "Q5_K": 1.1, "IQ4_XS": 1.06}
PACKED_RATIO["MXFP4"] = 1.06  # its exponent byte becomes a float16 scale
# The grid types' indices are unpacked to a 3-bit (IQ1, IQ2) or 4-bit (IQ3) index of their
# levels, 1 factor byte per 16 and a float16 d per 256: 3.56 or 4.56 bits a weight.
PACKED_RATIO.update({"IQ2_XXS": 1.73, "IQ2_XS": 1.55, "IQ2_S": 1.4, "IQ3_XXS": 1.49})
PACKED_RATIO.update({"IQ3_S": 1.33, "IQ1_S": 2.29, "IQ1_M": 2.04})
ROUNDED_SCALES = ["Q4_K", "Q5_K", "IQ4_XS"]  # float16 products of two factors


def test_every_type_packs_at_about_its_size():
    for name in TYPES:
        qtype = gk.SUPPORTED_TYPES[name]
        packed = gk.pack(torch.from_numpy(random_blocks(name, 32, 512)), qtype, 512)
        ratio = packed.numel() / (32 * gk.row_bytes(qtype, 512))
        assert ratio <= PACKED_RATIO.get(name, 1.0), (name, ratio)


def test_packed_weights_lie_in_huge_page_spans(monkeypatch):
    """A packed weight of 2 MiB or more starts on a 2 MiB boundary (whole huge pages), and
    with the switch on or off it holds the same bytes and gives the same product."""
    raw = torch.from_numpy(random_blocks("Q4_0", 4096, 1024))  # 2.25 MiB packed
    qtype = gk.SUPPORTED_TYPES["Q4_0"]
    huge = gk.pack(raw, qtype, 1024)
    assert huge.data_ptr() % HUGE_PAGE == 0 and huge.numel() == raw.numel()
    monkeypatch.setenv("MINIVLLM_CPU_HUGE_PAGES", "0")
    plain = gk.pack(raw, qtype, 1024)
    assert torch.equal(huge, plain)
    x = torch.randn(3, 1024)
    assert torch.equal(
        gk.matmul_packed(x, huge, qtype, 4096, 1024), gk.matmul_packed(x, plain, qtype, 4096, 1024)
    )


@pytest.mark.parametrize("name", TYPES)
def test_packed_weights_dequantize_as_the_blocks(name):
    qtype = gk.SUPPORTED_TYPES[name]
    raw = random_blocks(name, rows=21, k=512, seed=4)  # 21 rows: a padded second tile
    packed = gk.pack(torch.from_numpy(raw), qtype, 512)
    expected = torch.from_numpy(reference(name, raw))
    got = gk.dequantize_packed(packed, qtype, 21, 512)
    if name in ROUNDED_SCALES:
        # the k-quants' scales (a float16 times a small integer factor) and minimums are
        # rounded to float16: s * (u - off) + m moves by at most
        # 2^-11 (|s * (u - off)| + |m|) <= 2^-11 * 4 * max |w| of the 16 values
        groups = expected.reshape(21, -1, 16)
        bound = groups.abs().amax(-1, keepdim=True) * 4 * 2**-11 + 1e-7
        assert ((got.reshape(21, -1, 16) - groups).abs() <= bound).all()
        assert not torch.equal(got, expected)  # so the bound is what this checks
    else:  # the file's float16 scales are kept: bit-exact
        assert torch.equal(got, expected)
    rows = torch.tensor([20, 0, 17])
    assert torch.equal(gk.dequantize_packed(packed, qtype, 21, 512, rows), got[rows])
    # a few ids are checked as a list, many by reductions: both refuse what is outside
    many = torch.arange(100) % 21
    assert torch.equal(gk.dequantize_packed(packed, qtype, 21, 512, many), got[many])
    for bad in ([21], [3, -1], [*range(70), 21], [*range(70), -1]):
        with pytest.raises(IndexError):
            gk.dequantize_packed(packed, qtype, 21, 512, torch.tensor(bad))


@pytest.mark.parametrize("path", list(_VARIANTS))
@pytest.mark.parametrize("name", TYPES)
# m = 70, 130: the prompt path (each tile decoded once) for every type on AVX-512
@pytest.mark.parametrize("m", [1, 6, 70, 130])
def test_packed_product_is_the_product_with_int8_activations(path, name, m):
    lib = variant(path)
    qtype = gk.SUPPORTED_TYPES[name]
    n, k = 37, 512  # 3 tiles of 16 rows, the last partial; m = 6, 70, 130: 4 rows and 1-3 left
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
    # and close to the product with the file's weights (int8 activations: a few percent)
    reference_product = F.linear(x, torch.from_numpy(reference(name, raw)))
    assert ((got - reference_product).abs().max() / reference_product.abs().max()) < 0.03


@pytest.mark.parametrize("path", list(_VARIANTS))
# values of 2, 4 and 8 bits, high planes, minimums, k-quant factors, levels, a grid
@pytest.mark.parametrize(
    "name", ["Q4_0", "Q4_1", "Q8_0", "Q5_K", "Q6_K", "Q2_K", "IQ4_XS", "IQ2_S"]
)
def test_each_row_of_a_few_row_product_is_its_own_product(path, name):
    """A product of 2 or 3 rows (the 2- and 3-row tile kernels) and of 5-7 (4 rows, then the
    1-3 left in one call) gives each row bit for bit what the row's product alone gives:
    every row has its own accumulators whatever the kernel's row count."""
    lib = variant(path)
    qtype = gk.SUPPORTED_TYPES[name]
    n, k = 37, 512
    packed = gk.pack(torch.from_numpy(random_blocks(name, rows=n, k=k, seed=5)), qtype, k, lib)
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(5)) * 3
    alone = torch.cat([gk.matmul_packed(x[i : i + 1], packed, qtype, n, k, lib) for i in range(7)])
    for m in (2, 3, 5, 6, 7):
        assert torch.equal(gk.matmul_packed(x[:m], packed, qtype, n, k, lib), alone[:m]), m


def packed_weights(names: list[str], rows: list[int], k: int, experts: int, lib, seed: int):
    """One weight of every expert as segments of packed blocks (one type per segment), and
    the segments' packed tensors per expert."""
    per_expert = []
    for e in range(experts):
        segments = []
        for s, (name, n) in enumerate(zip(names, rows, strict=True)):
            raw = torch.from_numpy(random_blocks(name, n, k, seed=seed + 10 * e + s))
            segments.append(gk.pack(raw, gk.SUPPORTED_TYPES[name], k, lib))
        per_expert.append(segments)
    table = gk.PackedSegments(
        torch.tensor([gk.SUPPORTED_TYPES[n] for n in names]),
        torch.tensor(rows),
        torch.tensor([sum(rows[:s]) for s in range(len(rows))]),
        torch.tensor([p.data_ptr() for segments in per_expert for p in segments]),
        k,
        tuple(p for segments in per_expert for p in segments),
    )
    return table, per_expert


@pytest.mark.parametrize("path", list(_VARIANTS))
@pytest.mark.parametrize("m", [1, 5, 40])
@pytest.mark.parametrize("renormalize", [True, False])
# gate, up, down: activation terms of different offsets, groups of 32 and 16, minimums
@pytest.mark.parametrize("types", [("Q8_0", "Q4_0", "Q6_K"), ("Q4_K", "Q5_0", "Q2_K")])
def test_moe_forward_sums_each_chosen_experts_packed_products(path, m, renormalize, types):
    """The one-call layer equals its definition, written with torch's routing and
    matmul_packed: per token, its top 3 experts by softmax; per choice, gate/up (two
    segments of different types), silu(gate) * up, down (a k-quant), weighted."""
    lib = variant(path)
    experts, top_k, hidden, inter = 6, 3, 256, 256  # k-quants take k in blocks of 256
    gate_up, gu = packed_weights(list(types[:2]), [inter, inter], hidden, experts, lib, 1)
    down, dn = packed_weights([types[2]], [hidden], inter, experts, lib, 2)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, hidden, generator=g)
    logits = torch.randn(m, experts, generator=g) * 2
    logits[:, 5] = -30  # expert 5 is never chosen; with 40 tokens some take 4 rows at once

    got = gk.moe_forward(x, logits, top_k, renormalize, gk.PackedExperts(gate_up, down), lib)

    weights, ids = torch.topk(torch.softmax(logits, dim=-1), top_k)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    expected = torch.zeros(m, hidden)
    gate_type, up_type, down_type = (gk.SUPPORTED_TYPES[n] for n in types)
    for t in range(m):
        for j in range(top_k):
            e = int(ids[t, j])
            gate = gk.matmul_packed(x[t : t + 1], gu[e][0], gate_type, inter, hidden, lib)
            up = gk.matmul_packed(x[t : t + 1], gu[e][1], up_type, inter, hidden, lib)
            y = gk.matmul_packed(F.silu(gate) * up, dn[e][0], down_type, hidden, inter, lib)
            expected[t] += weights[t, j] * y[0]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
    assert float(expected.abs().max()) > 0


@pytest.mark.parametrize("path", list(_VARIANTS))
@pytest.mark.parametrize("m", [1, 40])
def test_moe_forward_with_gpt_oss_biases_and_gating(path, m):
    """gpt-oss's experts (MXFP4, as its files): biases on gate_up's and down's outputs,
    (up + 1) * g * sigmoid(alpha * g) with g and up clamped, as activation.py's module."""
    from minivllm.model.layers.activation import SwigluOAIAndMul

    lib = variant(path)
    experts, top_k, hidden, inter = 4, 2, 256, 256
    gate_up, gu = packed_weights(["MXFP4", "MXFP4"], [inter, inter], hidden, experts, lib, 3)
    down, dn = packed_weights(["MXFP4"], [hidden], inter, experts, lib, 4)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, hidden, generator=g) * 4  # gate/up values past the limit
    logits = torch.randn(m, experts, generator=g) * 2
    gate_up_bias = torch.randn(experts, 2 * inter, generator=g)
    down_bias = torch.randn(experts, hidden, generator=g)
    act = SwigluOAIAndMul(1.702, 7.0)
    packed = gk.PackedExperts(gate_up, down, gate_up_bias, down_bias, (act.alpha, act.limit))

    got = gk.moe_forward(x, logits, top_k, True, packed, lib)

    weights, ids = torch.topk(torch.softmax(logits, dim=-1), top_k)
    weights = weights / weights.sum(-1, keepdim=True)
    expected = torch.zeros(m, hidden)
    mxfp4 = gk.SUPPORTED_TYPES["MXFP4"]
    for t in range(m):
        for j in range(top_k):
            e = int(ids[t, j])
            gate = gk.matmul_packed(x[t : t + 1], gu[e][0], mxfp4, inter, hidden, lib)
            up = gk.matmul_packed(x[t : t + 1], gu[e][1], mxfp4, inter, hidden, lib)
            h = act(torch.cat([gate, up], dim=-1) + gate_up_bias[e])
            assert bool((torch.cat([gate, up], -1).abs() > act.limit).any())
            y = gk.matmul_packed(h, dn[e][0], mxfp4, hidden, inter, lib) + down_bias[e]
            expected[t] += weights[t, j] * y[0]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


def test_moe_forward_refuses_what_it_cannot_take():
    gate_up, _ = packed_weights(["Q4_0"], [512], 256, 4, None, 0)
    down, _ = packed_weights(["Q4_0"], [256], 256, 4, None, 0)
    experts = gk.PackedExperts(gate_up, down)
    x, logits = torch.randn(2, 256), torch.randn(2, 4)
    with pytest.raises(ValueError, match="do not fit"):
        gk.moe_forward(torch.randn(2, 128), logits, 2, True, experts)
    with pytest.raises(ValueError, match="do not fit"):
        gk.moe_forward(x, torch.randn(2, 5), 2, True, experts)
    with pytest.raises(ValueError, match="do not fit"):
        gk.moe_forward(x, logits, 5, True, experts)
    # gate_up's rows are not twice down's input features
    short, _ = packed_weights(["Q4_0"], [256], 256, 4, None, 0)
    with pytest.raises(ValueError, match="do not fit hidden 256 and intermediate 256"):
        gk.PackedExperts(short, down)
    fewer, _ = packed_weights(["Q4_0"], [512], 256, 3, None, 0)
    with pytest.raises(ValueError, match="numbers of experts"):
        gk.PackedExperts(fewer, down)
    with pytest.raises(ValueError, match=r"biases must be \[4, 512\] float32"):
        gk.PackedExperts(gate_up, down, gate_up_bias=torch.zeros(4, 256))
