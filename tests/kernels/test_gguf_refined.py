"""gguf_packed_matmul_refined (issue 49): the int8 product plus a second int8 pass over each
activation row's block of largest max|x|, on each path of the kernels, against float64
references: the product with the activations rounded as the kernel rounds them (that block
twice), and the one with float activations, which it must come much closer to than the
plain product does where one channel is an outlier (as the residual stream's are)."""

from __future__ import annotations

import pytest
import torch

from minivllm.kernels import gguf_kernels as gk
from tests.kernels.test_gguf_kernels import _VARIANTS, random_blocks, variant

pytestmark = pytest.mark.skipif(gk.load_gguf_kernels() is None, reason="no C compiler")

REFINED = ["Q8_0", "Q4_0", "Q4_1", "Q5_1", "IQ4_NL"]


def activations(m: int, k: int, seed: int) -> torch.Tensor:
    """Rows whose channel 41 (in block 1) is an outlier, 40x the others, as SmolLM2's
    residual stream carries; every third row has its outlier in the last block instead."""
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    x[:, 41] = 40 * torch.sign(x[:, 41] + 0.5)
    x[1::3, 41] = 0.5
    x[1::3, k - 5] = -60
    return x


def int8_rounded(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [m, k] float32 rounded as the kernels round it (per 32 values, max|x| / 127, half
    to even), as [m, k / 32, 32] in float64, and each block's max|x|."""
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    d = amax / 127
    inverse = torch.where(d > 0, 1 / torch.where(d > 0, d, 1), 0)
    return torch.round(blocks * inverse).double() * d.double(), amax.squeeze(-1)


def refined_activations(x: torch.Tensor) -> torch.Tensor:
    """What the refined product multiplies: x int8-rounded, and each row's block of largest
    max|x| plus its rounding error (float32, as the kernel takes it) rounded again."""
    m, k = x.shape
    rounded, amax = int8_rounded(x)
    costliest = amax.argmax(-1)
    error = (x.reshape(m, -1, 32) - rounded.float())[torch.arange(m), costliest]
    rounded[torch.arange(m), costliest] += int8_rounded(error)[0].squeeze(1)
    return rounded.reshape(m, k)


@pytest.mark.parametrize("path", list(_VARIANTS))
@pytest.mark.parametrize("name", REFINED)
# m = 1, 6 and 70: a decode step's loop, each tile refined after its product (calls of 1
# and of 4 rows); 130: the prompt path (tiles decoded once; AVX-512 and AVX2); n = 1000
# and 37: the last tile partial
@pytest.mark.parametrize("m, n", [(1, 1000), (6, 1000), (70, 37), (130, 37)])
def test_refined_product_is_exact_on_the_costliest_block(path, name, m, n):
    lib = variant(path)
    qtype = gk.SUPPORTED_TYPES[name]
    k = 256
    raw = random_blocks(name, rows=n, k=k, seed=m)
    packed = gk.pack(torch.from_numpy(raw), qtype, k, lib)
    weight = gk.dequantize_packed(packed, qtype, n, k, lib=lib).double()
    x = activations(m, k, seed=m)
    got = gk.matmul_packed(x, packed, qtype, n, k, lib, refined=True).double()
    plain = gk.matmul_packed(x, packed, qtype, n, k, lib).double()
    expected = refined_activations(x) @ weight.T
    exact = x.double() @ weight.T
    scale = exact.abs().max()
    assert (got - expected).abs().max() / scale < 1e-5
    # and the outlier's block held most of the plain product's error
    assert (got - exact).abs().max() < 0.2 * (plain - exact).abs().max()


@pytest.mark.parametrize("path", list(_VARIANTS))
@pytest.mark.parametrize("name", ["Q8_0", "Q4_1"])
def test_each_row_of_a_few_row_refined_product_is_its_own_product(path, name):
    """Rows whose refined blocks are the same block share one tile kernel's call (2 of the 3
    rows here, 4 and 2 of 6, 4, 1 and 2 of 7); each row still gets bit for bit its product
    alone."""
    lib = variant(path)
    qtype = gk.SUPPORTED_TYPES[name]
    n, k = 37, 256
    packed = gk.pack(torch.from_numpy(random_blocks(name, rows=n, k=k, seed=7)), qtype, k, lib)
    x = activations(7, k, seed=7)
    alone = torch.cat(
        [gk.matmul_packed(x[i : i + 1], packed, qtype, n, k, lib, refined=True) for i in range(7)]
    )
    for m in (2, 3, 6, 7):
        got = gk.matmul_packed(x[:m], packed, qtype, n, k, lib, refined=True)
        assert torch.equal(got, alone[:m]), m


def test_refined_kernel_refuses_types_whose_blocks_do_not_stand_alone():
    qtype = gk.SUPPORTED_TYPES["Q6_K"]
    assert not gk.refines(qtype) and gk.refines(gk.SUPPORTED_TYPES["Q8_0"])
    packed = gk.pack(torch.from_numpy(random_blocks("Q6_K", 16, 256)), qtype, 256)
    with pytest.raises(ValueError, match="refused"):
        gk.matmul_packed(torch.randn(1, 256), packed, qtype, 16, 256, refined=True)
