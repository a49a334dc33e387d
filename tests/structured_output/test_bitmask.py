"""The grammar bitmask kernel against a plain reference: every forbidden token of the rows
given gets -inf, everything else keeps its value bit for bit."""

from __future__ import annotations

import pytest
import torch

from minivllm.structured_output.bitmask import _apply_with_xgrammar, _kernel, apply_token_bitmask


def reference(logits, rows, bitmask):
    out = logits.clone()
    vocab = min(logits.shape[1], bitmask.shape[1] * 32)
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    forbidden = (bits.view(bitmask.shape[0], -1) == 0)[:, :vocab]
    for i, r in enumerate(rows.tolist()):
        out[r, :vocab] = out[r, :vocab].masked_fill(forbidden[i], float("-inf"))
    return out


def random_bitmask(n, words, generator):
    """Rows mixing the three kinds of word: all allowed, none allowed, and random bits
    (sign bit included)."""
    bitmask = torch.randint(-(2**31), 2**31, (n, words), dtype=torch.int64, generator=generator)
    bitmask = bitmask.to(torch.int32)
    kind = torch.randint(0, 3, (n, words), generator=generator)
    bitmask[kind == 0] = -1
    bitmask[kind == 1] = 0
    return bitmask


@pytest.mark.parametrize("vocab", [49152, 1000, 31, 64])
@pytest.mark.parametrize("apply", [apply_token_bitmask, "xgrammar"])
def test_matches_the_reference(vocab, apply):
    if apply == apply_token_bitmask and _kernel() is None:
        pytest.skip("no C compiler")
    g = torch.Generator().manual_seed(vocab)
    batch = 7
    words = (vocab + 31) // 32
    logits = torch.randn(batch, vocab, generator=g)
    rows = torch.tensor([5, 0, 3, 6])  # a subset, out of order
    bitmask = random_bitmask(len(rows), words, g)
    expected = reference(logits, rows, bitmask)
    if apply == "xgrammar":
        _apply_with_xgrammar(logits, rows, bitmask, vocab)
    else:
        apply(logits, rows, bitmask)
    assert torch.equal(logits, expected)
    untouched = [r for r in range(batch) if r not in rows.tolist()]
    assert torch.isfinite(logits[untouched]).all()


def test_strided_rows_and_a_wider_bitmask():
    """Logits rows that are a slice of a wider tensor, and a bitmask over a padded vocabulary
    (more words than the logits need): only the logits' own columns are written."""
    if _kernel() is None:
        pytest.skip("no C compiler")
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(4, 130, generator=g)
    logits = wide[:, :100]
    rows = torch.arange(4)
    bitmask = random_bitmask(4, 8, g)  # covers 256 tokens
    expected_wide = wide.clone()
    expected_wide[:, :100] = reference(wide[:, :100].contiguous(), rows, bitmask)
    apply_token_bitmask(logits, rows, bitmask)
    assert torch.equal(wide, expected_wide)


def test_rows_out_of_range_raise():
    if _kernel() is None:
        pytest.skip("no C compiler")
    logits = torch.zeros(2, 64)
    with pytest.raises(IndexError):
        apply_token_bitmask(logits, torch.tensor([2]), torch.zeros(1, 2, dtype=torch.int32))
