"""The gated short convolution (LFM2) with per-request conv states: the C kernel and the
Triton kernel (interpreted on CPU tensors in CI, compiled with a GPU) against the plain-torch
reference in float64, on random chunks, decode rows, padded slots and strided rows."""

from __future__ import annotations

import pytest
import torch

from minivllm.kernels.conv_kernels import (
    gated_short_conv,
    gated_short_conv_reference,
    load_conv_kernels,
)

DIM, K, SLOTS = 40, 3, 6


def _case(lengths: list[int], seed: int = 0, stride_pad: int = 0):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    bcx = torch.randn(total, 3 * DIM + stride_pad, generator=g, dtype=torch.float64)
    bcx = bcx[:, stride_pad:]  # rows stride_pad wider than they are: a view of a fused output
    weight = torch.randn(DIM, K, generator=g, dtype=torch.float64)
    state = torch.randn(SLOTS, DIM, K - 1, generator=g, dtype=torch.float64)
    slots = torch.randperm(SLOTS, generator=g)[: len(lengths)]
    qsl = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(lengths).cumsum(0)
    return bcx, weight, state, slots, qsl


def test_the_reference_carries_the_state_across_chunks_exactly():
    bcx, weight, state, slots, _ = _case([11])
    whole_state = state.clone()
    whole = gated_short_conv_reference(bcx, weight, whole_state, slots, torch.tensor([0, 11]))
    chunked_state = state.clone()
    pieces = []
    for start, end in [(0, 1), (1, 5), (5, 6), (6, 11)]:  # chunks, one a single token
        pieces.append(
            gated_short_conv_reference(
                bcx[start:end], weight, chunked_state, slots, torch.tensor([0, end - start])
            )
        )
    torch.testing.assert_close(torch.cat(pieces), whole, rtol=0, atol=1e-12)
    torch.testing.assert_close(chunked_state, whole_state, rtol=0, atol=0)
    # A zero state is a sequence's start: causal padding, as HF's conv1d.
    zero = torch.zeros_like(state)
    y = gated_short_conv_reference(bcx, weight, zero, slots, torch.tensor([0, 11]))
    b, c, x = bcx.split(DIM, -1)
    conv = torch.nn.functional.conv1d((b * x).T[None], weight[:, None], padding=K - 1, groups=DIM)[
        0, :, :11
    ].T
    torch.testing.assert_close(y, c * conv)


def _backends():
    yield pytest.param("c", marks=pytest.mark.skipif(load_conv_kernels() is None, reason="no cc"))
    from tests.kernels.test_triton_attention import DEVICES

    for device in DEVICES:
        yield pytest.param(f"triton-{device.values[0]}", marks=device.marks)


def _run(backend: str, bcx, weight, state, slots, qsl):
    if backend == "c":
        return gated_short_conv(bcx, weight, state, slots, qsl)
    from minivllm.kernels.triton_conv import gated_short_conv_triton

    return gated_short_conv_triton(bcx, weight, state, slots, qsl)


@pytest.mark.parametrize("backend", list(_backends()))
@pytest.mark.parametrize(
    "lengths", [[7, 1, 3, 2], [1, 1, 1], [2], [5, 0, 4]], ids=["mixed", "decode", "short", "empty"]
)
@pytest.mark.parametrize("decode_rows", [False, True])
def test_kernels_equal_the_float64_reference(backend, lengths, decode_rows):
    if decode_rows and set(lengths) != {1}:
        pytest.skip("decode rows are one token each")
    device = "cuda" if backend == "triton-cuda" else "cpu"
    bcx, weight, state, slots, qsl = _case(lengths, seed=len(lengths), stride_pad=5)
    want_state = state.clone()
    want = gated_short_conv_reference(bcx, weight, want_state, slots, qsl)
    got_state = state.float().to(device)
    got = _run(
        backend,
        bcx.float().to(device),
        weight.float().contiguous().to(device),
        got_state,
        slots.to(device),
        None if decode_rows else qsl.to(device),
    )
    torch.testing.assert_close(got.double().cpu(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_state.double().cpu(), want_state, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("backend", list(_backends()))
@pytest.mark.parametrize("decode_rows", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_mamba_conv_with_bias_and_silu_equals_the_reference(backend, decode_rows, with_bias):
    from minivllm.kernels.conv_kernels import causal_conv1d, causal_conv1d_reference

    lengths = [1, 1, 1] if decode_rows else [6, 1, 3]
    device = "cuda" if backend == "triton-cuda" else "cpu"
    bcx, weight, state, slots, qsl = _case(lengths, seed=7, stride_pad=3)
    x = bcx[:, :DIM]  # strided rows
    bias = torch.randn(DIM, dtype=torch.float64) if with_bias else None
    qsl = None if decode_rows else qsl
    want_state = state.clone()
    want = causal_conv1d_reference(x, weight, bias, want_state, slots, qsl, True)
    got_state = state.float().to(device)
    args = (
        x.float().to(device),
        weight.float().contiguous().to(device),
        bias.float().to(device) if bias is not None else None,
        got_state,
        slots.to(device),
        qsl.to(device) if qsl is not None else None,
    )
    if backend == "c":
        got = causal_conv1d(*args, silu=True)
    else:
        from minivllm.kernels.triton_conv import causal_conv1d_triton

        got = causal_conv1d_triton(*args, silu=True)
    torch.testing.assert_close(got.double().cpu(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_state.double().cpu(), want_state, atol=1e-6, rtol=1e-6)


@pytest.mark.skipif(load_conv_kernels() is None, reason="no C compiler")
@pytest.mark.parametrize("k", [2, 4, 5])  # unrolled tap counts and the general loop
@pytest.mark.parametrize("decode_rows", [False, True])
def test_the_c_kernels_take_wide_layers_in_blocks_of_channels(k, decode_rows):
    """600 channels (blocks of 256 and 512 with a remainder, the C kernels' units of work)
    at each tap count, the gated (LFM2) and the plain (Mamba-2, Qwen3.5) convolutions."""
    from minivllm.kernels.conv_kernels import causal_conv1d, causal_conv1d_reference

    g = torch.Generator().manual_seed(k)
    dim, lengths = 600, [1, 1] if decode_rows else [9, 3]
    bcx = torch.randn(sum(lengths), 3 * dim, generator=g, dtype=torch.float64)
    weight = torch.randn(dim, k, generator=g, dtype=torch.float64)
    state = torch.randn(3, dim, k - 1, generator=g, dtype=torch.float64)
    slots = torch.tensor([2, 0])
    qsl = None if decode_rows else torch.tensor([0, lengths[0], sum(lengths)], dtype=torch.int32)
    bias = torch.randn(dim, generator=g, dtype=torch.float64)
    for gated in (True, False):
        want_state = state.clone()
        got_state = state.float()
        if gated:
            want = gated_short_conv_reference(bcx, weight, want_state, slots, qsl)
            got = gated_short_conv(bcx.float(), weight.float(), got_state, slots, qsl)
        else:
            x = bcx[:, :dim]
            want = causal_conv1d_reference(x, weight, bias, want_state, slots, qsl, True)
            got = causal_conv1d(x.float(), weight.float(), bias.float(), got_state, slots, qsl)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_state.double(), want_state, atol=1e-6, rtol=1e-6)
