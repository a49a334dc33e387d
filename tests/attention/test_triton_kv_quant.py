"""The Triton backend with a quantized KV cache (under TRITON_INTERPRET=1 without a GPU):
the write quantizes as torch's reference does, and attention over the uint8 cache read in
place equals dense attention over the values the cache holds."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from minivllm.attention.kv_quant import (  # noqa: E402
    dequantize_rows,
    kv_cache_format,
    quantize_rows,
)
from minivllm.attention.triton import TritonAttentionBackend, kv_views  # noqa: E402
from minivllm.kernels.triton_kv_cache import reshape_and_cache  # noqa: E402
from tests.attention.test_cpu_attention import dense_attention  # noqa: E402
from tests.attention.test_triton_backend import common_metadata  # noqa: E402
from tests.kernels.test_triton_attention import DEVICES, make_batch  # noqa: E402

H, HKV, D, BS = 6, 2, 32, 8
FORMATS = ["fp16k_int8v", "fp16k_e4m3v", "fp16k_e5m2v", "int8k_int8v", "e4m3k_e4m3v", "e5m2k_e5m2v"]


def new_cache(fmt, num_blocks, device):
    """A zeroed cache as the worker allocates it (block-major for fp16k_int8v), its keys
    and values as the kernels take them, and both as [slots, HKV, row] (copies)."""
    backend = TritonAttentionBackend(kv_cache_dtype=fmt.name)
    zeros = lambda shape, dtype: torch.zeros(shape, dtype=dtype, device=device)  # noqa: E731
    cache = backend.new_kv_cache(zeros, num_blocks, BS, HKV, D, torch.float32)
    return cache, *kv_views(cache, fmt)


def flat(rows: torch.Tensor) -> torch.Tensor:
    return rows.reshape(-1, HKV, rows.shape[-1]).cpu()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", FORMATS)
def test_the_write_quantizes_as_the_reference(device, name):
    fmt = kv_cache_format(name)
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(2, 12, HKV, D, generator=g) * 4).to(device)
    k[2] = 0
    k[3, 0, 0] = 1e6  # float16 keys saturate
    cache, k_cache, v_cache = new_cache(fmt, 4, device)
    slots = torch.tensor([5, 0, 31, 7, 8, 9, -1, 20, 21, 22, 1, 2], device=device)
    reshape_and_cache(k, v, k_cache, v_cache, slots, fmt.code)
    keep = slots.cpu() >= 0
    expected = quantize_rows(k.cpu()[keep], fmt, keys=True)
    got_k = flat(k_cache)[slots.cpu()[keep]][..., : expected.shape[-1]]
    if fmt.scale_bytes and not fmt.fp16_keys:  # int8 keys: ties round away from zero here,
        # to even in torch: a step at most
        diff = got_k[..., :D].view(torch.int8).int() - expected[..., :D].view(torch.int8).int()
        assert diff.abs().max() <= 1
        assert torch.equal(got_k[..., D:], expected[..., D:])  # the scales
    else:
        assert torch.equal(got_k, expected)
    back = dequantize_rows(flat(v_cache)[slots.cpu()[keep]], fmt, D)
    assert torch.allclose(back, v.cpu()[keep], atol=0.3, rtol=0.15)
    # Slot 6 was never named, and slot -1 wrote nothing.
    assert flat(k_cache)[6].eq(0).all() and flat(v_cache)[6].eq(0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("window", [None, 5])
def test_attention_reads_the_quantized_cache_in_place(device, name, window):
    fmt = kv_cache_format(name)
    seq_lens, query_lens = [9, 20, 5, 30], [1, 6, 5, 1]
    batch = make_batch(seq_lens, query_lens, H, HKV, D, BS, torch.float32, device, seed=3)
    num_blocks = batch.kv_cache.shape[1]
    cache, k_cache, v_cache = new_cache(fmt, num_blocks, device)
    # The earlier context written quantized; this step's tokens by the backend.
    table = batch.block_table.cpu()
    all_slots = [
        torch.tensor([int(table[i, p // BS]) * BS + p % BS for p in range(n)])
        for i, n in enumerate(seq_lens)
    ]
    for i, (n, q_len) in enumerate(zip(seq_lens, query_lens)):
        context = all_slots[i][: n - q_len].to(device)
        k, v = batch.full_k[i][: n - q_len].to(device), batch.full_v[i][: n - q_len].to(device)
        reshape_and_cache(k, v, k_cache, v_cache, context, fmt.code)
    backend = TritonAttentionBackend(kv_cache_dtype=name)
    meta = backend.build_metadata(common_metadata(batch))
    scale = D**-0.5
    out = backend.forward(batch.q, batch.new_k, batch.new_v, cache, meta, scale, window)
    out = out.view(-1, H, D).cpu()
    keys, values = flat(k_cache), flat(v_cache)
    qsl = batch.query_start_loc.tolist()
    for i in range(len(seq_lens)):
        ks = dequantize_rows(keys[all_slots[i]], fmt, D, keys=True)
        vs = dequantize_rows(values[all_slots[i]], fmt, D)
        expected = dense_attention(batch.q[qsl[i] : qsl[i + 1]].cpu(), ks, vs, scale, window)
        torch.testing.assert_close(out[qsl[i] : qsl[i + 1]], expected, atol=2e-5, rtol=1e-4)
