"""The CPU attention paths against a dense reference on random paged caches, fed the flat
metadata every backend takes."""

from __future__ import annotations

import sys

import pytest
import torch

from minivllm.attention.backend import CommonAttentionMetadata
from minivllm.attention.cpu import CPUAttentionBackend, write_kv
from minivllm.kernels.cpu_kernels import load_kernels, load_library
from tests.kernels.test_cpu_kernels import WIDTHS

H, HKV, NUM_BLOCKS = 6, 2, 64


def dense_attention(q, k, v, scale, window=None, soft_cap=None, sinks=None):
    """q: [L, H, D] at the last L positions of k, v: [S, HKV, D]; causal, a query at p
    seeing keys in (p - window, p]; scores soft-capped as HF's eager Gemma attention; sinks
    [H] as HF's eager gpt-oss attention (a logit per head in the softmax, with no value)."""
    L, S = q.shape[0], k.shape[0]
    k = k.repeat_interleave(H // HKV, dim=1)
    v = v.repeat_interleave(H // HKV, dim=1)
    scores = torch.einsum("lhd,shd->hls", q, k) * scale
    if soft_cap:
        scores = torch.tanh(scores / soft_cap) * soft_cap
    key_pos, query_pos = torch.arange(S)[None, :], torch.arange(S - L, S)[:, None]
    mask = key_pos > query_pos
    if window is not None:
        mask |= key_pos <= query_pos - window
    scores = scores.masked_fill(mask, float("-inf"))
    if sinks is None:
        return torch.einsum("hls,shd->lhd", scores.softmax(-1), v)
    column = sinks.view(-1, 1, 1).expand(-1, L, 1)
    probs = torch.cat([scores, column], dim=-1).softmax(-1)[..., :-1]
    return torch.einsum("hls,shd->lhd", probs, v)


def make_batch(seq_lens, query_lens, BS, D, seed=0):
    """A paged cache holding each request's earlier tokens, and this step's new tokens."""
    g = torch.Generator().manual_seed(seed)
    cache = torch.zeros(2, NUM_BLOCKS, BS, HKV, D)
    perm = torch.randperm(NUM_BLOCKS, generator=g).tolist()  # scattered block ids
    tables, full_k, full_v, slots = [], [], [], []
    for seq_len, qlen in zip(seq_lens, query_lens):
        n = -(-seq_len // BS)
        table = [perm.pop() for _ in range(n)]
        tables.append(table)
        k = torch.randn(seq_len, HKV, D, generator=g)
        v = torch.randn(seq_len, HKV, D, generator=g)
        context = [table[p // BS] * BS + p % BS for p in range(seq_len - qlen)]
        write_kv(
            cache, k[: len(context)], v[: len(context)], torch.tensor(context, dtype=torch.long)
        )
        slots += [table[p // BS] * BS + p % BS for p in range(seq_len - qlen, seq_len)]
        full_k.append(k)
        full_v.append(v)
    q = torch.randn(sum(query_lens), H, D, generator=g)
    return cache, tables, full_k, full_v, torch.tensor(slots), q


def common_metadata(seq_lens, query_lens, tables, slots) -> CommonAttentionMetadata:
    width = max(len(t) for t in tables)
    query_start_loc = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=query_start_loc,
        seq_lens=seq_lens_t,
        block_table=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=slots,
        num_actual_tokens=sum(query_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens_t,
    )


def test_one_token_rows_are_batched_and_several_token_spans_kept_apart():
    """Without the kernel: a one-token chunk after a prefix hit is a one-token row like a
    decode; each row's table holds only the blocks its context fills."""
    seq_lens, query_lens = [9, 1, 17, 40, 33], [1, 1, 6, 1, 33]
    tables = [[3, 5, 7], [2], [11, 12, 13, 14, 15], list(range(20, 30)), list(range(40, 49))]
    slots = torch.arange(sum(query_lens), dtype=torch.long)
    backend = CPUAttentionBackend(4)
    backend.kernels = None
    meta = backend.build_metadata(common_metadata(seq_lens, query_lens, tables, slots))
    assert meta.num_tokens == 42 and meta.slot_mapping is slots
    assert meta.num_singles == 3
    assert meta.single_rows.tolist() == [0, 1, 8]
    assert meta.single_seq_lens.tolist() == [9, 1, 40]
    assert meta.single_block_table.tolist() == [
        [3, 5, 7] + [0] * 7,
        [2] + [0] * 9,
        list(range(20, 30)),
    ]
    assert meta.single_rows.dtype == meta.single_block_table.dtype == torch.long
    assert [(s.start, s.end, s.seq_len, s.block_ids.tolist()) for s in meta.spans] == [
        (2, 8, 17, [11, 12, 13, 14, 15]),
        (9, 42, 33, list(range(40, 49))),
    ]


needs_kernel = pytest.mark.skipif(
    load_kernels("MINIVLLM_CPU_ATTN_KERNEL") is None, reason="no C compiler"
)


@needs_kernel
def test_with_the_kernel_every_token_is_a_row_seeing_its_own_context():
    seq_lens, query_lens = [9, 7, 3], [1, 3, 3]  # a decode, a chunk after context, a prompt
    tables = [[3, 5, 7], [2, 4], [11]]
    slots = torch.arange(7, dtype=torch.long)
    meta = CPUAttentionBackend(4).build_metadata(
        common_metadata(seq_lens, query_lens, tables, slots)
    )
    assert meta.num_singles == meta.num_tokens == 7 and not meta.spans
    assert meta.single_rows.tolist() == list(range(7))
    assert meta.single_seq_lens.tolist() == [9, 5, 6, 7, 1, 2, 3]
    assert meta.single_block_table.tolist() == [[3, 5, 7]] + [[2, 4, 0]] * 3 + [[11, 0, 0]] * 3


@needs_kernel
@pytest.mark.parametrize("window", [None, 5])
def test_a_prompt_attends_the_same_whole_chunked_or_after_a_cached_prefix(window):
    """Bit for bit: how a prompt is split into steps never changes a token's attention."""
    BS, D, n = 4, 64, 13
    cache, tables, ks, vs, slots, q = make_batch([n], [n], BS, D)
    backend, scale = CPUAttentionBackend(BS), D**-0.5

    def attend(first, last):  # tokens [first, last) of the prompt in one step
        meta = backend.build_metadata(
            common_metadata([last], [last - first], tables, slots[first:last])
        )
        k, v = ks[0][first:last], vs[0][first:last]
        return backend.forward(q[first:last], k, v, cache, meta, scale, window).clone()

    whole = attend(0, n)
    assert torch.equal(torch.cat([attend(0, 5), attend(5, 6), attend(6, n)]), whole)
    assert torch.equal(attend(8, n), whole[8:])  # the first 8 positions cached earlier


# (4, 16) takes the kernel's general loop, block size 16 its vectorized paths.
@pytest.mark.parametrize("BS, D", [(4, 16), (16, 64), (16, 128), (16, 256)])
@pytest.mark.parametrize("use_kernel", [False, True])
# Windows shorter than a block, across blocks, longer than every sequence; soft-capping;
# gpt-oss's sinks, alone and with a window.
@pytest.mark.parametrize(
    "window, soft_cap, sinks",
    [
        (None, None, False),
        (3, None, False),
        (21, None, False),
        (64, None, False),
        (None, 2.0, False),
        (6, 2.0, False),
        (None, None, True),
        (5, None, True),
    ],
)
def test_mixed_prefill_chunks_and_decodes_match_dense(use_kernel, BS, D, window, soft_cap, sinks):
    if use_kernel and load_kernels("MINIVLLM_CPU_ATTN_KERNEL") is None:
        pytest.skip("no C compiler")
    seq_lens = [9, 1, 17, 5, 40, 30, 33]
    query_lens = [1, 1, 6, 5, 1, 3, 33]  # decodes, chunks with context, fresh prefills
    cache, tables, ks, vs, slots, q = make_batch(seq_lens, query_lens, BS, D)
    rows = torch.cumsum(torch.tensor([0] + query_lens), 0).tolist()
    new_k = torch.cat([k[-n:] for k, n in zip(ks, query_lens)])
    new_v = torch.cat([v[-n:] for v, n in zip(vs, query_lens)])
    backend = CPUAttentionBackend(BS)
    if not use_kernel:
        backend.kernels = None
    meta = backend.build_metadata(common_metadata(seq_lens, query_lens, tables, slots))
    scale = D**-0.5
    # Sinks that take most of a row's weight (6.0) and almost none (-8.0).
    sinks = torch.tensor([3.0, -2.0, 0.5, 6.0, -8.0, 1.0]) if sinks else None
    out = backend.forward(q, new_k, new_v, cache, meta, scale, window, soft_cap, sinks)
    out = out.view(-1, H, D)
    for i in range(len(seq_lens)):
        expected = dense_attention(
            q[rows[i] : rows[i + 1]], ks[i], vs[i], scale, window, soft_cap, sinks
        )
        torch.testing.assert_close(out[rows[i] : rows[i + 1]], expected, atol=1e-5, rtol=1e-4)


def kernel_backend(BS: int, width: str) -> CPUAttentionBackend:
    backend = CPUAttentionBackend(BS)
    backend.kernels = load_library(WIDTHS[width])
    assert backend.kernels is not None
    return backend


@needs_kernel
@pytest.mark.parametrize("width", list(WIDTHS))
@pytest.mark.parametrize("BS, D", [(4, 16), (16, 64), (16, 128), (16, 256)])
@pytest.mark.parametrize("window", [None, 3, 21])
@pytest.mark.parametrize("heads", [(6, 2), (4, 4)])  # 3 query heads a KV head, and 1
def test_a_tile_of_rows_attends_each_row_as_it_would_alone(
    monkeypatch, width, BS, D, window, heads
):
    """The kernel attends a prompt's rows in tiles that share loads; each row's result is bit
    for bit what it is alone (a decode) and in a tile of any other size or alignment. (The
    two head layouts give the value passes every width from 1 to 6 (row, head) pairs.)"""
    monkeypatch.setattr(sys.modules[__name__], "H", heads[0])
    monkeypatch.setattr(sys.modules[__name__], "HKV", heads[1])
    seq_lens, query_lens = [40, 9, 33, 23], [19, 1, 33, 11]
    cache, tables, ks, vs, slots, q = make_batch(seq_lens, query_lens, BS, D, seed=1)
    new_k = torch.cat([k[-n:] for k, n in zip(ks, query_lens)])
    new_v = torch.cat([v[-n:] for v, n in zip(vs, query_lens)])
    backend, scale = kernel_backend(BS, width), D**-0.5
    meta = backend.build_metadata(common_metadata(seq_lens, query_lens, tables, slots))
    assert meta.tiles.tolist() == [0, 8, 16, 19, 20, 28, 36, 44, 52, 53, 61, 64]
    tiled = backend.forward(q, new_k, new_v, cache, meta, scale, window).clone()
    meta.tiles = None  # every row alone
    assert torch.equal(backend.forward(q, new_k, new_v, cache, meta, scale, window), tiled)
    # Tiles of other sizes and starts (the kernel takes one of 11 rows in pieces of 8).
    meta.tiles = torch.tensor([0, 1, 8, 15, 19, 20, 21, 29, 37, 45, 53, 64])
    assert torch.equal(backend.forward(q, new_k, new_v, cache, meta, scale, window), tiled)


@needs_kernel
@pytest.mark.parametrize("width", list(WIDTHS))
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("heads", [(6, 2), (16, 2)])  # 3 and 8 query heads a KV head
def test_long_contexts_match_dense_and_each_row_alone(monkeypatch, width, D, heads):
    """Past 64 positions a value sum goes in spans and past 8 blocks the scores do, and a lone
    row's 8 query heads of one KV head take two passes of the score kernel: each row still
    equals dense attention, and bit for bit itself alone."""
    monkeypatch.setattr(sys.modules[__name__], "H", heads[0])
    monkeypatch.setattr(sys.modules[__name__], "HKV", heads[1])
    seq_lens, query_lens = [300, 1, 200], [1, 1, 45]
    cache, tables, ks, vs, slots, q = make_batch(seq_lens, query_lens, 16, D, seed=2)
    new_k = torch.cat([k[-n:] for k, n in zip(ks, query_lens)])
    new_v = torch.cat([v[-n:] for v, n in zip(vs, query_lens)])
    backend, scale = kernel_backend(16, width), D**-0.5
    meta = backend.build_metadata(common_metadata(seq_lens, query_lens, tables, slots))
    tiled = backend.forward(q, new_k, new_v, cache, meta, scale, None).view(-1, H, D).clone()
    rows = torch.cumsum(torch.tensor([0] + query_lens), 0).tolist()
    for i in range(len(seq_lens)):
        expected = dense_attention(q[rows[i] : rows[i + 1]], ks[i], vs[i], scale)
        torch.testing.assert_close(tiled[rows[i] : rows[i + 1]], expected, atol=1e-5, rtol=1e-4)
    meta.tiles = None  # every row alone
    alone = backend.forward(q, new_k, new_v, cache, meta, scale, None).view(-1, H, D)
    assert torch.equal(alone, tiled)


@needs_kernel
@pytest.mark.parametrize("width", list(WIDTHS))
@pytest.mark.parametrize("BS, D", [(4, 16), (16, 64), (16, 128), (16, 256)])
@pytest.mark.parametrize("heads", [(6, 2), (4, 4), (16, 2), (4, 1)])
@pytest.mark.parametrize("window, soft_cap, with_sinks", [(None, None, False), (21, 2.0, True)])
def test_threads_share_a_short_batch_by_heads_bit_for_bit(
    monkeypatch, width, BS, D, heads, window, soft_cap, with_sinks
):
    """With fewer tiles than threads (a lone decode row) the threads take a tile's query
    heads in pieces; every head is bit for bit what one thread makes of the whole tile, and
    a row alone what it is in a batch."""
    monkeypatch.setattr(sys.modules[__name__], "H", heads[0])
    monkeypatch.setattr(sys.modules[__name__], "HKV", heads[1])
    seq_lens, query_lens = [150, 9, 40], [1, 1, 1]
    cache, tables, ks, vs, slots, q = make_batch(seq_lens, query_lens, BS, D, seed=3)
    new_k = torch.stack([k[-1] for k in ks])
    new_v = torch.stack([v[-1] for v in vs])
    backend, scale = kernel_backend(BS, width), D**-0.5
    sinks = torch.linspace(-3.0, 3.0, H) if with_sinks else None

    def attend(rows):
        meta = backend.build_metadata(
            common_metadata(
                [seq_lens[i] for i in rows], [1] * len(rows), [tables[i] for i in rows], slots[rows]
            )
        )
        args = (q[rows], new_k[rows], new_v[rows], cache, meta, scale, window, soft_cap, sinks)
        return backend.forward(*args).view(-1, H, D).clone()

    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        expected = attend([0, 1, 2])
        torch.testing.assert_close(
            expected[0], dense_attention(q[:1], ks[0], vs[0], scale, window, soft_cap, sinks)[0]
        )
        for threads in (2, 3, 8):  # 8: the batch of 3 rows is shared by heads too
            torch.set_num_threads(threads)
            assert torch.equal(attend([0, 1, 2]), expected)
            for i in range(3):
                assert torch.equal(attend([i]), expected[i : i + 1])
    finally:
        torch.set_num_threads(saved)
