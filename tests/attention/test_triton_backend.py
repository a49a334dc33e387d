"""The Triton attention backend: common metadata in, this step's K/V written, attention out,
against the float64 reference (under TRITON_INTERPRET=1 without a GPU, as the kernels'
own tests)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from minivllm.attention.backend import CommonAttentionMetadata  # noqa: E402
from minivllm.attention.cpu import CPUAttentionBackend  # noqa: E402
from minivllm.attention.triton import TritonAttentionBackend  # noqa: E402
from minivllm.kernels.triton_attention import INTERPRETED, choose_kv_splits  # noqa: E402
from tests.kernels.test_triton_attention import (  # noqa: E402
    DEVICES,
    QUERY_LENS,
    SEQ_LENS,
    Batch,
    check,
    make_batch,
)


def common_metadata(batch: Batch, padding: int = 0) -> CommonAttentionMetadata:
    """The batch's metadata; `padding` extra rows (slot -1) after the real ones, as a
    CUDA graph's padded batch has."""
    slots = batch.slot_mapping
    if padding:
        slots = torch.cat([slots, slots.new_full((padding,), -1)])
    qsl, seq_lens = batch.query_start_loc, batch.seq_lens
    return CommonAttentionMetadata(
        query_start_loc=qsl,
        seq_lens=seq_lens,
        block_table=batch.block_table,
        slot_mapping=slots,
        num_actual_tokens=batch.q.shape[0],
        max_query_len=int((qsl[1:] - qsl[:-1]).max()),
        max_seq_len=int(seq_lens.max()),
        query_start_loc_cpu=qsl.cpu(),
        seq_lens_cpu=seq_lens.cpu(),
    )


def test_the_cuda_platform_takes_this_backend(monkeypatch):
    from minivllm.platforms import get_platform

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # device "auto" sees a GPU
    assert get_platform("auto").get_attn_backend_cls() is TritonAttentionBackend


def test_cache_shape_keeps_a_token_row_contiguous():
    shape = TritonAttentionBackend.get_kv_cache_shape(10, 16, 2, 64)
    assert shape == (2, 10, 16, 2, 64)
    assert TritonAttentionBackend.get_name() == "TRITON_ATTN"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_writes_the_cache_and_matches_float64(device, dtype):
    batch = make_batch(SEQ_LENS, QUERY_LENS, 8, 2, 32, 8, dtype, device, seed=5)
    backend = TritonAttentionBackend()
    padding = 3
    meta = backend.build_metadata(common_metadata(batch, padding))
    num_tokens = batch.q.shape[0]

    def pad(x):  # rows a padded batch carries after the real ones
        return torch.cat([x, torch.full_like(x[:padding], float("nan"))])

    before = batch.kv_cache.clone()
    scale = 32**-0.5
    out = backend.forward(
        pad(batch.q), pad(batch.new_k), pad(batch.new_v), batch.kv_cache, meta, scale, 5, 20.0
    )
    assert out.shape == (num_tokens + padding, 8 * 32)
    check(batch, out[:num_tokens].view(batch.q.shape), scale, 5, 20.0)
    # The new K/V are at their slots; the padded rows wrote nothing.
    flat = batch.kv_cache.view(2, -1, 2, 32)
    assert torch.equal(flat[0, batch.slot_mapping], batch.new_k)
    assert torch.equal(flat[1, batch.slot_mapping], batch.new_v)
    written = torch.zeros(flat.shape[1], dtype=torch.bool, device=device)
    written[batch.slot_mapping] = True
    untouched = before.view(2, -1, 2, 32)[:, ~written]
    torch.testing.assert_close(flat[:, ~written], untouched, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("device", DEVICES)
def test_long_single_token_rows_take_split_kv_and_match_float64(device):
    # Two decodes of 600 and 1100 keys: 2 splits (>= 512 keys each); off, one pass.
    batch = make_batch([600, 1100], [1, 1], 4, 2, 16, 16, torch.float32, device, seed=7)
    scale = 16**-0.5
    assert choose_kv_splits(2, 2, 1, 1100, 16) == 2
    for max_kv_splits in (16, 1):
        backend = TritonAttentionBackend(max_kv_splits=max_kv_splits)
        meta = backend.build_metadata(common_metadata(batch))
        out = backend.forward(batch.q, batch.new_k, batch.new_v, batch.kv_cache, meta, scale)
        check(batch, out.view(batch.q.shape), scale)


def two_steps(seq_lens, query_lens, block_size, seed):
    """Step 1 writes each request's context (a prompt, or a chunk of one); step 2 is the
    mixed batch: (steps, kv cache shape), each step (common metadata, q, k, v)."""
    g = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads, head_dim = 8, 2, 32
    blocks = [-(-s // block_size) for s in seq_lens]
    perm = torch.randperm(sum(blocks) + 2, generator=g).tolist()
    tables, taken = [], 0
    for n in blocks:
        tables.append(perm[taken : taken + n])
        taken += n
    width = max(blocks)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    steps = []
    for lens, firsts in (
        ([s - q for s, q in zip(seq_lens, query_lens)], [0] * len(seq_lens)),
        (query_lens, [s - q for s, q in zip(seq_lens, query_lens)]),
    ):
        keep = [i for i, n in enumerate(lens) if n > 0]  # a request with no context yet
        qsl = torch.tensor([0] + [lens[i] for i in keep]).cumsum(0).to(torch.int32)
        ends = torch.tensor([firsts[i] + lens[i] for i in keep], dtype=torch.int32)
        slots = [
            tables[i][p // block_size] * block_size + p % block_size
            for i in keep
            for p in range(firsts[i], firsts[i] + lens[i])
        ]
        common = CommonAttentionMetadata(
            query_start_loc=qsl,
            seq_lens=ends,
            block_table=table[keep],
            slot_mapping=torch.tensor(slots),
            num_actual_tokens=len(slots),
            max_query_len=max(lens[i] for i in keep),
            max_seq_len=int(ends.max()),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=ends,
        )
        t = len(slots)
        q = torch.randn(t, num_heads, head_dim, generator=g)
        k = torch.randn(t, num_kv_heads, head_dim, generator=g)
        v = torch.randn(t, num_kv_heads, head_dim, generator=g)
        steps.append((common, q, k, v))
    shape = (2, sum(blocks) + 2, block_size, num_kv_heads, head_dim)
    return steps, shape


@pytest.mark.skipif(not INTERPRETED, reason="compares on the CPU, under the interpreter")
@pytest.mark.parametrize("window, soft_cap", [(None, None), (6, 30.0)])
def test_equals_the_cpu_backend_over_two_steps(window, soft_cap):
    # Step 2: decodes, a chunk after context, a fresh prompt (no context in step 1).
    steps, shape = two_steps([9, 21, 40, 13], [1, 6, 1, 13], 8, seed=9)
    cpu, triton_backend = CPUAttentionBackend(8), TritonAttentionBackend()
    cpu_cache, triton_cache = torch.zeros(shape), torch.zeros(shape)
    for common, q, k, v in steps:
        expected = cpu.forward(
            q, k, v, cpu_cache, cpu.build_metadata(common), 0.2, window, soft_cap
        )
        out = triton_backend.forward(
            q, k, v, triton_cache, triton_backend.build_metadata(common), 0.2, window, soft_cap
        )
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)
