"""The Triton attention backend: common metadata in, this step's K/V written, attention out,
against the float64 reference (under TRITON_INTERPRET=1 without a GPU, as the kernels'
own tests)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from minivllm.attention.triton import TritonAttentionBackend  # noqa: E402
from minivllm.kernels.triton_attention import choose_kv_splits  # noqa: E402
from tests.kernels.test_triton_attention import (  # noqa: E402
    DEVICES,
    QUERY_LENS,
    SEQ_LENS,
    Batch,
    check,
    make_batch,
)


@dataclass
class CommonAttentionMetadata:  # stand-in until minivllm.attention.backend has it
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor


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
