"""Quantized KV caches (--kv-cache-dtype): the C kernels and torch write the same bytes, and
attention over the quantized cache equals dense attention over the dequantized K/V, with
the kernel reading the cache in place and without it."""

from __future__ import annotations

import pytest
import torch

from minivllm.attention.cpu import CPUAttentionBackend, torch_cache
from minivllm.attention.kv_quant import (
    dequantize_rows,
    kv_cache_format,
    quantize_rows,
)
from minivllm.kernels.cpu_kernels import load_kernels, load_library
from tests.attention.test_cpu_attention import common_metadata, dense_attention
from tests.kernels.test_cpu_kernels import WIDTHS

H, HKV, NUM_BLOCKS = 6, 2, 64
FORMATS = ["fp16k_int8v", "fp16k_e4m3v", "fp16k_e5m2v", "int8k_int8v", "e4m3k_e4m3v", "e5m2k_e5m2v"]
needs_kernel = pytest.mark.skipif(
    load_kernels("MINIVLLM_CPU_ATTN_KERNEL") is None, reason="no C compiler"
)


def test_names_and_row_widths():
    assert kv_cache_format("fp8") == kv_cache_format("fp8_e4m3") == kv_cache_format("fp16k_e4m3v")
    assert kv_cache_format("fp8_e5m2") == kv_cache_format("fp16k_e5m2v")
    assert kv_cache_format("int8") == kv_cache_format("fp16k_int8v")
    assert kv_cache_format("int8k_int8v").row_width(64) == 68  # the scale after the values
    assert kv_cache_format("e5m2k_e5m2v").row_width(64) == 64
    # Two rows of 98 bytes hold a head's 128 bytes of float16 key and 68 of 8-bit value.
    assert kv_cache_format("fp16k_int8v").row_width(64) == 98
    assert kv_cache_format("fp8").row_width(64) == kv_cache_format("fp8_e5m2").row_width(64) == 98
    assert not kv_cache_format("auto").quantized
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_cache_format("q4_0")


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("keys", [False, True])
def test_rows_round_trip_within_the_formats_precision(name, keys):
    fmt = kv_cache_format(name)
    x = torch.randn(50, HKV, 64, generator=torch.Generator().manual_seed(0)) * 3
    x[0, 0] = 0  # a zero row: scale 0, no NaN
    back = dequantize_rows(quantize_rows(x, fmt, keys), fmt, 64, keys)
    assert torch.equal(back[0, 0], torch.zeros(64))
    # int8: half a step of the row's amax / 127; float16: 10 mantissa bits; e4m3: 3; e5m2: 2
    # (and a scaled row's subnormals, steps of its amax / 448 * 2^-9 at most).
    if keys and fmt.fp16_keys:
        assert ((back - x).abs() <= x.abs() * 2**-11).all()
        assert not torch.equal(back, x)  # rounded: the test can tell
    elif fmt.fp8_dtype is None:
        bound = x.abs().amax(-1, keepdim=True) / 254 + 1e-6
        assert ((back - x).abs() <= bound).all()
    else:
        rel = 2**-4 if fmt.fp8_dtype == torch.float8_e4m3fn else 2**-3
        assert ((back - x).abs() <= x.abs() * rel + 2**-9).all()


@pytest.mark.parametrize("name", ["fp16k_e4m3v", "fp16k_e5m2v"])
def test_fp8_values_are_scaled_to_each_rows_range(name):
    """A row of tiny values keeps fp8's relative precision (scale 1 would make them
    subnormals or zeros), and a row of large ones does not saturate at e4m3's 448."""
    fmt = kv_cache_format(name)
    rel = 2**-4 if fmt.fp8_dtype == torch.float8_e4m3fn else 2**-3
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(1)).abs() + 0.5
    x[0] *= 1e-5
    x[1] *= 1e4
    back = dequantize_rows(quantize_rows(x, fmt), fmt, 64)
    assert ((back - x).abs() <= x.abs() * rel).all()


def test_float16_keys_saturate():
    fmt = kv_cache_format("fp16k_int8v")
    x = torch.tensor([[1e6, -1e6, 3.0, 0.0]])
    back = dequantize_rows(quantize_rows(x, fmt, keys=True), fmt, 4, keys=True)
    assert back.tolist() == [[65504.0, -65504.0, 3.0, 0.0]]


def new_cache(name, num_blocks, BS, D):
    """A zeroed layer cache of the format as the worker allocates it (block-major for
    fp16k_int8v)."""
    backend = CPUAttentionBackend(BS, kv_cache_dtype=name)
    zeros = lambda shape, dtype: torch.zeros(shape, dtype=dtype)  # noqa: E731
    return backend.new_kv_cache(zeros, num_blocks, BS, HKV, D, torch.float32)


def quantized_batch(seq_lens, query_lens, BS, D, fmt, seed=0):
    """A quantized paged cache holding each request's earlier tokens (written by torch),
    this step's new tokens, and each request's K/V as the cache holds them (dequantized)."""
    g = torch.Generator().manual_seed(seed)
    cache = new_cache(fmt.name, NUM_BLOCKS, BS, D)
    perm = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    tables, held_k, held_v, slots, new_k, new_v = [], [], [], [], [], []
    for seq_len, qlen in zip(seq_lens, query_lens):
        table = [perm.pop() for _ in range(-(-seq_len // BS))]
        tables.append(table)
        k, v = torch.randn(2, seq_len, HKV, D, generator=g) * 2
        flat = torch.tensor([table[p // BS] * BS + p % BS for p in range(seq_len)])
        context = seq_len - qlen
        torch_cache(cache, fmt, D).write(k[:context], v[:context], flat[:context])
        slots.append(flat[context:])
        new_k.append(k[context:])
        new_v.append(v[context:])
        held_k.append(dequantize_rows(quantize_rows(k, fmt, keys=True), fmt, D, keys=True))
        held_v.append(dequantize_rows(quantize_rows(v, fmt), fmt, D))
    q = torch.randn(sum(query_lens), H, D, generator=g)
    return cache, tables, held_k, held_v, torch.cat(slots), torch.cat(new_k), torch.cat(new_v), q


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("BS, D", [(4, 16), (16, 64), (16, 128), (16, 256)])
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
    expected, got = new_cache(name, NUM_BLOCKS, BS, D), new_cache(name, NUM_BLOCKS, BS, D)
    torch_cache(expected, fmt, D).write(k, v, slots)
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
    # Tiles whose rows end on both sides of a multiple of 64 positions (the value pass goes
    # in spans of 64), so a tile's common pass and each row's own positions split there too;
    # also under a sliding window (each row's first position its own).
    seq_lens, query_lens = [40, 9, 300, 150], [19, 1, 33, 40]
    cache, tables, _, _, slots, new_k, new_v, q = quantized_batch(
        seq_lens, query_lens, 16, 64, fmt, seed=1
    )
    backend = CPUAttentionBackend(16, kv_cache_dtype=name)
    backend.kernels = load_library(WIDTHS[width])
    for window in (None, 50):
        meta = backend.build_metadata(common_metadata(seq_lens, query_lens, tables, slots))
        tiled = backend.forward(q, new_k, new_v, cache, meta, 0.125, window).clone()
        meta.tiles = None
        assert torch.equal(backend.forward(q, new_k, new_v, cache, meta, 0.125, window), tiled)
