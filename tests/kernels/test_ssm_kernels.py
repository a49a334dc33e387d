"""Mamba-2's selective scan with per-request SSM states: the chunked (SSD) torch form, the
C kernel and the Triton kernel (interpreted on CPU tensors in CI, compiled with a GPU)
against the recurrence in float64, on prompt chunks of several requests, decode rows and
strided inputs (views of one projection, as the model passes them)."""

from __future__ import annotations

import pytest
import torch

from minivllm.kernels import ssm_kernels
from minivllm.kernels.ssm_kernels import (
    load_ssm_kernels,
    mamba2_scan,
    mamba2_scan_chunked,
    mamba2_scan_reference,
)

HEADS, HEAD_DIM, GROUPS, N, SLOTS = 4, 6, 2, 8, 5


def _case(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    width = HEADS * HEAD_DIM + 2 * GROUPS * N + HEADS + 3
    rows = torch.randn(total, width, generator=g, dtype=torch.float64)
    x, b, c, dt = rows[:, 3:].split([HEADS * HEAD_DIM, GROUPS * N, GROUPS * N, HEADS], -1)
    A = -torch.rand(HEADS, generator=g, dtype=torch.float64) * 2 - 0.1
    D = torch.randn(HEADS, generator=g, dtype=torch.float64)
    dt_bias = torch.randn(HEADS, generator=g, dtype=torch.float64)
    state = torch.randn(SLOTS, HEADS, HEAD_DIM, N, generator=g, dtype=torch.float64)
    slots = torch.randperm(SLOTS, generator=g)[: len(lengths)]
    qsl = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(lengths).cumsum(0)
    return (x, dt, A, b, c, D, dt_bias), state, slots, qsl


@pytest.mark.parametrize("dt_limit", [(0.0, float("inf")), (0.05, 0.5)])
def test_the_chunked_form_equals_the_recurrence(monkeypatch, dt_limit):
    monkeypatch.setattr(ssm_kernels, "SSD_CHUNK", 4)  # several chunks a prompt
    args, state, slots, qsl = _case([11, 1, 4, 0, 9])
    want_state, got_state = state.clone(), state.clone()
    want = mamba2_scan_reference(*args, want_state, slots, qsl, dt_limit)
    got = mamba2_scan_chunked(*args, got_state, slots, qsl, dt_limit)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(got_state, want_state, atol=1e-10, rtol=1e-10)


def test_chunks_of_a_prompt_carry_the_state_exactly():
    args, state, slots, qsl = _case([10])
    whole_state = state.clone()
    whole = mamba2_scan_reference(*args, whole_state, slots, qsl)
    split_state = state.clone()
    pieces = []
    for start, end in [(0, 3), (3, 4), (4, 10)]:
        part = [a[start:end] if a.dim() == 2 else a for a in args]
        lengths = torch.tensor([0, end - start], dtype=torch.int32)
        pieces.append(mamba2_scan_reference(*part, split_state, slots, lengths))
    torch.testing.assert_close(torch.cat(pieces), whole, atol=1e-12, rtol=0)
    torch.testing.assert_close(split_state, whole_state, atol=1e-12, rtol=0)


def _backends():
    yield pytest.param("c", marks=pytest.mark.skipif(load_ssm_kernels() is None, reason="no cc"))
    from tests.kernels.test_triton_attention import DEVICES

    for device in DEVICES:
        yield pytest.param(f"triton-{device.values[0]}", marks=device.marks)


@pytest.mark.parametrize("backend", list(_backends()))
@pytest.mark.parametrize("lengths", [[7, 1, 3], [1, 1, 1, 1]], ids=["prompts", "decode"])
def test_kernels_equal_the_float64_recurrence(backend, lengths):
    device = "cuda" if backend == "triton-cuda" else "cpu"
    args, state, slots, qsl = _case(lengths, seed=3)
    qsl = None if set(lengths) == {1} else qsl  # decode rows: row i is request i
    dt_limit = (0.01, 4.0)
    want_state = state.clone()
    want = mamba2_scan_reference(*args, want_state, slots, qsl, dt_limit)
    got_state = state.float().to(device)
    f32 = [a.float().to(device) for a in args]
    qsl_d = qsl.to(device) if qsl is not None else None
    if backend == "c":
        got = mamba2_scan(*f32, got_state, slots.to(device), qsl_d, dt_limit)
    else:
        from minivllm.kernels.triton_ssm import mamba2_scan_triton

        got = mamba2_scan_triton(*f32, got_state, slots.to(device), qsl_d, dt_limit)
    torch.testing.assert_close(got.double().cpu(), want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(got_state.double().cpu(), want_state, atol=2e-5, rtol=1e-4)


def test_gated_rms_norm_kernel_equals_the_reference():
    from minivllm.kernels.ssm_kernels import gated_rms_norm, gated_rms_norm_reference

    if load_ssm_kernels() is None:
        pytest.skip("no C compiler")
    g = torch.Generator().manual_seed(5)
    rows = torch.randn(5, 3 * 24 + 7, generator=g, dtype=torch.float64)
    y, z = rows[:, :24].contiguous(), rows[:, 30:54]  # z: strided rows of a projection
    weight = torch.randn(24, generator=g, dtype=torch.float64)
    want = gated_rms_norm_reference(y, z, weight, 8, 1e-6)
    got = gated_rms_norm(y.float(), z.float(), weight.float(), 8, 1e-6)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
