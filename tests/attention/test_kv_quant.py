"""Quantized KV caches (--kv-cache-dtype): the C kernels and torch write the same bytes, and
attention over the quantized cache equals dense attention over the dequantized K/V, with
the kernel reading the cache in place and without it."""

from __future__ import annotations

import pytest
import torch

from minivllm.attention.cpu import CPUAttentionBackend, _QuantizedCache
from minivllm.attention.kv_quant import (
    dequantize_rows,
    kv_cache_format,
    quantize_rows,
)
from minivllm.kernels.cpu_kernels import load_kernels, load_library
from tests.attention.test_cpu_attention import common_metadata, dense_attention
from tests.kernels.test_cpu_kernels import WIDTHS

H, HKV, NUM_BLOCKS = 6, 2, 64
FORMATS = ["int8", "fp8_e4m3", "fp8_e5m2"]
needs_kernel = pytest.mark.skipif(
    load_kernels("MINIVLLM_CPU_ATTN_KERNEL") is None, reason="no C compiler"
)


def test_names_and_row_widths():
    assert kv_cache_format("fp8") == kv_cache_format("fp8_e4m3")
    assert kv_cache_format("int8").row_width(64) == 68  # the float32 scale after the values
    assert kv_cache_format("fp8_e5m2").row_width(64) == 64
    assert not kv_cache_format("auto").quantized
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_cache_format("q4_0")


@pytest.mark.parametrize("name", FORMATS)
def test_rows_round_trip_within_the_formats_precision(name):
    fmt = kv_cache_format(name)
    x = torch.randn(50, HKV, 64, generator=torch.Generator().manual_seed(0)) * 3
    x[0, 0] = 0  # a zero row: scale 0, no NaN
    back = dequantize_rows(quantize_rows(x, fmt), fmt, 64)
    assert torch.equal(back[0, 0], torch.zeros(64))
    # int8: half a step of the row's amax / 127; e4m3: 3 mantissa bits; e5m2: 2.
    if name == "int8":
        bound = x.abs().amax(-1, keepdim=True) / 254 + 1e-6
        assert ((back - x).abs() <= bound).all()
    else:
        rel = {"fp8_e4m3": 2**-4, "fp8_e5m2": 2**-3}[name]
        assert ((back - x).abs() <= x.abs() * rel + 2**-9).all()


def quantized_batch(seq_lens, query_lens, BS, D, fmt, seed=0):
    """A quantized paged cache holding each request's earlier tokens (written by torch),
    this step's new tokens, and each request's K/V as the cache holds them (dequantized)."""
    g = torch.Generator().manual_seed(seed)
    cache = torch.zeros(2, NUM_BLOCKS, BS, HKV, fmt.row_width(D), dtype=torch.uint8)
    perm = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    tables, held_k, held_v, slots, new_k, new_v = [], [], [], [], [], []
    for seq_len, qlen in zip(seq_lens, query_lens):
        table = [perm.pop() for _ in range(-(-seq_len // BS))]
        tables.append(table)
        k, v = torch.randn(2, seq_len, HKV, D, generator=g) * 2
        flat = torch.tensor([table[p // BS] * BS + p % BS for p in range(seq_len)])
        context = seq_len - qlen
        _QuantizedCache(cache, fmt, D).write(k[:context], v[:context], flat[:context])
        slots.append(flat[context:])
        new_k.append(k[context:])
        new_v.append(v[context:])
        held_k.append(dequantize_rows(quantize_rows(k, fmt), fmt, D))
        held_v.append(dequantize_rows(quantize_rows(v, fmt), fmt, D))
    q = torch.randn(sum(query_lens), H, D, generator=g)
    return cache, tables, held_k, held_v, torch.cat(slots), torch.cat(new_k), torch.cat(new_v), q


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("BS, D", [(4, 16), (16, 64), (16, 128)])
@pytest.mark.parametrize("use_kernel", [False, True])
@pytest.mark.parametrize("window", [None, 5])
def test_attention_over_a_quantized_cache_is_attention_over_its_values(
    name, BS, D, use_kernel, window
):
    if use_kernel and load_kernels("MINIVLLM_CPU_ATTN_KERNEL") is None:
        pytest.skip("no C compiler")
    fmt = kv_cache_format(name)
    seq_lens, query_lens = [9, 1, 17, 40, 33, 70], [1, 1, 6, 1, 33, 1]
    cache, tables, ks, vs, slots, new_k, new_v, q = quantized_batch(
        seq_lens, query_lens, BS, D, fmt
    )
    backend = CPUAttentionBackend(BS, kv_cache_dtype=name)
    if not use_kernel:
        backend.kernels = backend.write_kernel = None
    meta = backend.build_metadata(common_metadata(seq_lens, query_lens, tables, slots))
    out = backend.forward(q, new_k, new_v, cache, meta, D**-0.5, window).view(-1, H, D)
    rows = torch.cumsum(torch.tensor([0] + query_lens), 0).tolist()
    for i in range(len(seq_lens)):
        expected = dense_attention(q[rows[i] : rows[i + 1]], ks[i], vs[i], D**-0.5, window)
        torch.testing.assert_close(out[rows[i] : rows[i + 1]], expected, atol=2e-5, rtol=1e-4)


@needs_kernel
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("BS, D", [(4, 16), (16, 64)])
def test_the_kernels_write_the_bytes_torch_writes(name, BS, D):
    fmt = kv_cache_format(name)
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(2, 40, HKV, D, generator=g) * 5
    k[3] = 0
    slots = torch.randperm(NUM_BLOCKS * BS, generator=g)[:40]
    slots[7] = -1  # a padding row writes nothing
    expected = torch.zeros(2, NUM_BLOCKS, BS, HKV, fmt.row_width(D), dtype=torch.uint8)
    got = torch.zeros_like(expected)
    _QuantizedCache(expected, fmt, D).write(k, v, slots)
    backend = CPUAttentionBackend(BS, kv_cache_dtype=name)
    backend.kernels = None  # only the write goes through C
    meta = backend.build_metadata(common_metadata([40], [40], [list(range(-(-40 // BS)))], slots))
    backend.forward(torch.zeros(40, H, D), k, v, got, meta, 1.0)
    assert torch.equal(got, expected)


@needs_kernel
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("width", list(WIDTHS))
def test_a_tile_of_rows_reads_the_quantized_cache_as_each_row_alone(name, width):
    """Bit for bit, as with a float32 cache: a prompt's token attends the same whether its
    row is tiled with others or alone (a decode)."""
    fmt = kv_cache_format(name)
    seq_lens, query_lens = [40, 9, 300], [19, 1, 33]
    cache, tables, _, _, slots, new_k, new_v, q = quantized_batch(
        seq_lens, query_lens, 16, 64, fmt, seed=1
    )
    backend = CPUAttentionBackend(16, kv_cache_dtype=name)
    backend.kernels = load_library(WIDTHS[width])
    meta = backend.build_metadata(common_metadata(seq_lens, query_lens, tables, slots))
    tiled = backend.forward(q, new_k, new_v, cache, meta, 0.125).clone()
    meta.tiles = None
    assert torch.equal(backend.forward(q, new_k, new_v, cache, meta, 0.125), tiled)
