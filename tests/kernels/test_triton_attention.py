"""The Triton attention kernels against a float64 reference on random paged caches.

Without a GPU they run under Triton's interpreter (TRITON_INTERPRET=1, set by
tests/conftest.py before any test module imports the kernels) on CPU tensors; with one,
the same cases run compiled on CUDA (marked `gpu`). Cache slots that no token wrote hold
NaN, so a kernel that reads a wrong block, a slot past a request's end or a padded
block-table entry fails the comparison.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("triton")

from minivllm.kernels.triton_attention import (  # noqa: E402
    INTERPRETED,
    choose_kv_splits,
    unified_attention,
)
from minivllm.kernels.triton_kv_cache import reshape_and_cache  # noqa: E402

DEVICES = [
    pytest.param(
        "cpu", marks=pytest.mark.skipif(not INTERPRETED, reason="compiled Triton needs CUDA")
    ),
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(
                INTERPRETED or not torch.cuda.is_available(),
                reason="needs CUDA, not the interpreter",
            ),
        ],
    ),
]
TOLERANCE = {  # (atol, rtol) against float64, for outputs of size ~1
    torch.float32: (2e-5, 1e-4),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


@dataclass
class Batch:
    """One step: request i has seq_lens[i] tokens of context, its last query_lens[i] new."""

    q: torch.Tensor  # [T, H, D]
    new_k: torch.Tensor  # [T, Hkv, D], this step's keys
    new_v: torch.Tensor
    full_k: list[torch.Tensor]  # per request, [seq_len, Hkv, D]: every key, in order
    full_v: list[torch.Tensor]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, Hkv, D], context written, rest NaN
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_table: torch.Tensor  # [B, max_blocks] int32, scattered ids, padded with unused ones
    slot_mapping: torch.Tensor  # [T] int64, this step's slots


def make_batch(
    seq_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device, seed=0
) -> Batch:
    g = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_needed) + 3  # spare blocks stay NaN: the table's padding
    perm = torch.randperm(num_blocks, generator=g).tolist()
    spare = perm[: num_blocks - sum(blocks_needed)]
    cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
    cache = cache.to(dtype)
    max_blocks = max(blocks_needed) + 1
    tables, full_k, full_v, new_k, new_v, slots = [], [], [], [], [], []
    taken = len(spare)
    for seq_len, q_len, n in zip(seq_lens, query_lens, blocks_needed):
        table = perm[taken : taken + n]
        taken += n
        tables.append(table + [spare[len(tables) % len(spare)]] * (max_blocks - n))
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=g).to(dtype)
        seq_slots = torch.tensor(
            [table[p // block_size] * block_size + p % block_size for p in range(seq_len)]
        )
        context = seq_len - q_len
        flat = cache.view(2, -1, num_kv_heads, head_dim)
        flat[0, seq_slots[:context]] = k[:context]
        flat[1, seq_slots[:context]] = v[:context]
        slots.append(seq_slots[context:])
        full_k.append(k)
        full_v.append(v)
        new_k.append(k[context:])
        new_v.append(v[context:])
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=g).to(dtype)
    qsl = torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32)
    return Batch(
        q=q.to(device),
        new_k=torch.cat(new_k).to(device),
        new_v=torch.cat(new_v).to(device),
        full_k=full_k,
        full_v=full_v,
        kv_cache=cache.to(device),
        query_start_loc=qsl.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=torch.tensor(tables, dtype=torch.int32, device=device),
        slot_mapping=torch.cat(slots).to(device),
    )


def reference(batch: Batch, scale, window=None, soft_cap=None, sinks=None) -> torch.Tensor:
    """Dense float64 attention per request: [T, H, D]; sinks [H]: a logit per head in the
    softmax, with no value (HF's gpt-oss)."""
    outs = []
    qsl = batch.query_start_loc.tolist()
    for i, (k, v) in enumerate(zip(batch.full_k, batch.full_v)):
        q = batch.q[qsl[i] : qsl[i + 1]].cpu().double()
        k, v = k.double(), v.double()
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        s = torch.einsum("lhd,shd->hls", q, k) * scale
        if soft_cap:
            s = soft_cap * torch.tanh(s / soft_cap)
        seq_len, q_len = k.shape[0], q.shape[0]
        key_pos = torch.arange(seq_len)[None, :]
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        hide = key_pos > q_pos
        if window is not None:
            hide |= key_pos <= q_pos - window
        s = s.masked_fill(hide, float("-inf"))
        if sinks is None:
            probs = s.softmax(-1)
        else:
            column = sinks.cpu().double().view(-1, 1, 1).expand(-1, q_len, 1)
            probs = torch.cat([s, column], dim=-1).softmax(-1)[..., :-1]
        outs.append(torch.einsum("hls,shd->lhd", probs, v))
    return torch.cat(outs)


def run_kernels(
    batch: Batch, scale, window=None, soft_cap=None, splits=1, sinks=None
) -> torch.Tensor:
    query_lens = batch.query_start_loc[1:] - batch.query_start_loc[:-1]
    k_cache, v_cache = batch.kv_cache.unbind(0)
    reshape_and_cache(batch.new_k, batch.new_v, k_cache, v_cache, batch.slot_mapping)
    out = torch.empty_like(batch.q)
    unified_attention(
        batch.q,
        k_cache,
        v_cache,
        out,
        batch.query_start_loc,
        batch.seq_lens,
        batch.block_table,
        scale,
        sliding_window=window,
        logits_soft_cap=soft_cap,
        num_kv_splits=splits,
        max_query_len=int(query_lens.max()),
        sinks=sinks,
    )
    return out


def check(batch: Batch, out: torch.Tensor, scale, window=None, soft_cap=None, sinks=None):
    atol, rtol = TOLERANCE[batch.q.dtype]
    expected = reference(batch, scale, window, soft_cap, sinks)
    torch.testing.assert_close(out.cpu().double(), expected, atol=atol, rtol=rtol)


# Single-token rows with short and long contexts, chunks after a prefix (one longer than
# a query block), a fresh prompt, and ragged lengths that end mid-block.
SEQ_LENS = [9, 1, 21, 5, 40, 30, 19]
QUERY_LENS = [1, 1, 6, 5, 1, 3, 19]


@pytest.mark.parametrize("device", DEVICES)
def test_reshape_and_cache_writes_each_slot_and_skips_negative_ones(device):
    g = torch.Generator().manual_seed(1)
    k = torch.randn(5, 2, 24, generator=g).to(device)
    v = torch.randn(5, 2, 24, generator=g).to(device)
    cache = torch.zeros(2, 4, 8, 2, 24, device=device)
    slots = torch.tensor([17, 3, -1, 31, 8], device=device)
    reshape_and_cache(k, v, cache[0], cache[1], slots)
    expected = torch.zeros(2, 32, 2, 24)
    keep = slots.cpu() >= 0
    expected[0, slots.cpu()[keep]] = k.cpu()[keep]
    expected[1, slots.cpu()[keep]] = v.cpu()[keep]
    assert torch.equal(cache.cpu().view(2, 32, 2, 24), expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_dim, block_size",
    [
        (4, 4, 32, 16),  # no grouping
        (8, 2, 32, 4),  # GQA, blocks smaller than a key tile
        (6, 2, 40, 16),  # a group of 3 (rows of a query block left over), padded head_dim
        (32, 1, 16, 8),  # a group of 32: one query token per program
    ],
)
def test_mixed_batch_matches_float64(device, num_heads, num_kv_heads, head_dim, block_size):
    batch = make_batch(
        SEQ_LENS, QUERY_LENS, num_heads, num_kv_heads, head_dim, block_size, torch.float32, device
    )
    scale = head_dim**-0.5
    check(batch, run_kernels(batch, scale), scale)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "window, soft_cap",
    [(3, None), (12, None), (100, None), (None, 1.5), (7, 3.0)],
    ids=["window-3", "window-12", "window-past-all", "soft-cap", "window-and-cap"],
)
def test_windows_and_soft_cap_match_float64(device, window, soft_cap):
    batch = make_batch(SEQ_LENS, QUERY_LENS, 8, 2, 32, 8, torch.float32, device, seed=2)
    # A large scale makes the soft-cap bite (scores far beyond the cap).
    scale = 1.0 if soft_cap else 32**-0.5
    check(batch, run_kernels(batch, scale, window, soft_cap), scale, window, soft_cap)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [None, 9])
def test_long_chunk_takes_tall_programs_and_matches_float64(device, window):
    # A 70-row chunk after 30 tokens of context: 64-row programs (16-bit inputs), decodes
    # among them.
    batch = make_batch([100, 12, 33], [70, 1, 1], 4, 2, 32, 16, torch.float16, device, seed=8)
    scale = 32**-0.5
    check(batch, run_kernels(batch, scale, window), scale, window)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_requests_after_the_batch_are_skipped(device):
    # A CUDA graph's padded batch: requests with no query row and no context at the end.
    batch = make_batch(SEQ_LENS, QUERY_LENS, 8, 2, 32, 8, torch.float32, device, seed=10)
    out = run_kernels(batch, 0.2)
    pad = 3
    batch.query_start_loc = torch.cat(
        [batch.query_start_loc, batch.query_start_loc[-1:].repeat(pad)]
    )
    batch.seq_lens = torch.cat([batch.seq_lens, batch.seq_lens.new_zeros(pad)])
    batch.block_table = torch.cat([batch.block_table, batch.block_table[:pad] * 0])
    batch.q = torch.cat([batch.q, torch.full_like(batch.q[:5], float("nan"))])
    padded = run_kernels(batch, 0.2)
    assert torch.equal(padded[: out.shape[0]], out)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("splits, window", [(2, None), (4, 7)])
def test_split_kv_matches_float64(device, splits, window):
    # 4 splits of contexts of 1-3 tiles: some splits see no key, and must weigh nothing.
    batch = make_batch(SEQ_LENS, QUERY_LENS, 8, 2, 32, 8, torch.float32, device, seed=6)
    scale = 32**-0.5
    check(batch, run_kernels(batch, scale, window, splits=splits), scale, window)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "dtype, window, splits",
    [(torch.float32, None, 1), (torch.float32, 5, 1), (torch.float32, 7, 4), (torch.float16, 9, 2)],
)
def test_attention_sinks_match_float64(device, dtype, window, splits):
    """gpt-oss's sinks: large ones take most of a row's weight, small ones almost none; with
    split-KV, one split carries each sink."""
    batch = make_batch(SEQ_LENS, QUERY_LENS, 8, 2, 32, 8, dtype, device, seed=11)
    sinks = torch.tensor([3.0, -2.0, 0.5, 6.0, -8.0, 1.0, 0.0, 2.5], device=device)
    scale = 32**-0.5
    out = run_kernels(batch, scale, window, splits=splits, sinks=sinks)
    check(batch, out, scale, window, sinks=sinks)


def test_split_kv_only_for_few_long_decodes():
    assert choose_kv_splits(1, 8, 1, 8192, 16) == 16
    assert choose_kv_splits(1, 8, 1, 2048, 16) == 4  # >= 512 keys a split
    assert choose_kv_splits(1, 8, 1, 1023, 16) == 1
    assert choose_kv_splits(1, 8, 1, 8192, 4) == 4  # the cap
    assert choose_kv_splits(64, 8, 1, 8192, 16) == 1  # 512 programs already
    assert choose_kv_splits(1, 8, 2, 8192, 16) == 1  # a chunk in the batch
    assert choose_kv_splits(1, 8, 1, 8192, 1) == 1  # turned off


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_matches_float64(device, dtype):
    batch = make_batch(SEQ_LENS, QUERY_LENS, 8, 2, 64, 16, dtype, device, seed=3)
    scale = 64**-0.5
    check(batch, run_kernels(batch, scale, window=10), scale, window=10)


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_random_batches_match_float64(device, dtype):
    g = torch.Generator().manual_seed(4)
    for trial in range(3):
        batch_size = int(torch.randint(1, 12, (1,), generator=g))
        seq_lens = torch.randint(1, 160, (batch_size,), generator=g).tolist()
        query_lens = [
            int(torch.randint(1, s + 1, (1,), generator=g)) if trial % 2 else 1 for s in seq_lens
        ]
        batch = make_batch(seq_lens, query_lens, 16, 4, 128, 16, dtype, device, seed=trial)
        window = 64 if trial == 2 else None
        check(batch, run_kernels(batch, 0.1, window), 0.1, window)


@pytest.mark.parametrize("which", ["quick", pytest.param("all", marks=pytest.mark.slow)])
def test_kernels_compile_for_the_h100_without_a_gpu_and_spill_no_register(which, tmp_path):
    """The interpreter checks no types; compiling to an sm_90 cubin does (in a process
    where TRITON_INTERPRET is unset, so that the kernels are defined for compiling, and
    with an empty cache, so that ptxas runs and reports its spills)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    script = os.path.join(os.path.dirname(__file__), "triton_compile_check.py")
    root = os.path.dirname(os.path.dirname(os.path.dirname(script)))
    command = [sys.executable, script, "90"] + (["--all"] if which == "all" else [])
    done = subprocess.run(command, env=env, cwd=root, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if "compiled;" in line]
    assert len(lines) == (25 if which == "all" else 12), done.stdout  # 7 with quantized caches
    layers = [line for line in done.stdout.splitlines() if "layer kernels built;" in line]
    assert len(layers) == 3, done.stdout  # float32, bfloat16, float16
    assert all(line.endswith("spill bytes 0") for line in lines + layers), done.stdout
