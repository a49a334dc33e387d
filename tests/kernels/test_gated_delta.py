"""The gated delta rule's kernels (C for the CPU, Triton's recurrent and chunked forms under
the interpreter, compiled on CUDA with a GPU) against the torch reference in float64, on
random flat batches: a one-token decode, prompts longer than a chunk, a prompt cut into
pieces carried across calls by the state, grouped value heads, q/k/v as strided views of
one projection's rows, sequences that start from a zero state beside ones that read theirs.
Slots no sequence names must stay untouched."""

from __future__ import annotations

import pytest
import torch

from minivllm.kernels import gated_delta_torch as ref
from minivllm.kernels.gated_delta_cpu import gated_delta_rule as cpu_rule
from minivllm.kernels.gated_delta_cpu import load_kernel

HK, HV, DK, DV = 2, 4, 32, 16  # two value heads per key head
LENGTHS = [1, 5, 37, 16]  # a decode, a short prompt, one over two chunks, one exact chunk


def make_batch(lengths, seed: int, dtype=torch.float64):
    """Inputs as the layer has them: q, k, v views of the conv's output rows, a and b views
    of one projection's; four sequences in slots 5, 0, 3, 2 of 6; the first starts fresh."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    mixed = torch.randn(total, 2 * HK * DK + HV * DV + 3, generator=g, dtype=dtype)
    q = mixed[:, : HK * DK].view(total, HK, DK)
    k = mixed[:, HK * DK : 2 * HK * DK].view(total, HK, DK)
    v = mixed[:, 2 * HK * DK : 2 * HK * DK + HV * DV].view(total, HV, DV)
    ab = torch.randn(total, 2 * HV, generator=g, dtype=dtype) * 2
    a, b = ab[:, :HV], ab[:, HV:]
    A_log = torch.empty(HV, dtype=dtype).uniform_(0.01, 16, generator=g).log()
    dt_bias = torch.rand(HV, generator=g, dtype=dtype)
    state = torch.randn(6, HV, DK, DV, generator=g, dtype=dtype) * 0.5
    bounds = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    slots = torch.tensor([5, 0, 3, 2])[: len(lengths)]
    initial = torch.tensor([0, 1, 1, 1])[: len(lengths)]
    return q, k, v, a, b, A_log, dt_bias, state, bounds, slots, initial


def reference(q, k, v, a, b, A_log, dt_bias, state, bounds, slots, initial):
    """(out, state after) in float64 by the recurrent form."""
    g, beta = ref.gating(a.double(), b.double(), A_log.double(), dt_bias.double())
    state = state.double().clone()
    out = ref.gated_delta_rule(
        q.double(), k.double(), v.double(), g, beta, state, bounds, slots, initial.bool()
    )
    return out, state


def as_f32(batch, device="cpu"):
    """The batch in float32 (views kept views of one buffer), integers as int64."""
    q, k, v, a, b, A_log, dt_bias, state, bounds, slots, initial = batch
    mixed = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], 1).float().to(device)
    nq, nk = q[0].numel(), k[0].numel()
    q32 = mixed[:, :nq].view(q.shape)
    k32 = mixed[:, nq : nq + nk].view(k.shape)
    v32 = mixed[:, nq + nk :].view(v.shape)
    ab = torch.cat([a, b], 1).float().to(device)
    a32, b32 = ab[:, : a.shape[1]], ab[:, a.shape[1] :]
    rest = [x.float().to(device) for x in (A_log, dt_bias, state)]
    ints = [x.to(device) for x in (bounds, slots, initial)]
    return (q32, k32, v32, a32, b32, *rest, *ints)


def assert_close_to(got_out, got_state, want_out, want_state):
    torch.testing.assert_close(got_out.double().cpu(), want_out, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(got_state.double().cpu(), want_state, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("chunk_size", [4, 16, 64])
def test_the_chunked_form_equals_the_recurrent_one(chunk_size):
    batch = make_batch(LENGTHS, seed=0)
    want_out, want_state = reference(*batch)
    q, k, v, a, b, A_log, dt_bias, state, bounds, slots, initial = batch
    g, beta = ref.gating(a, b, A_log, dt_bias)
    state = state.clone()
    out = ref.gated_delta_rule(
        q, k, v, g, beta, state, bounds, slots, initial.bool(), chunk_size=chunk_size
    )
    torch.testing.assert_close(out, want_out, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(state, want_state, atol=1e-10, rtol=1e-10)


def test_the_reference_equals_transformers_functions():
    """HF's own torch forms (batch of one, float32 inside) give the same output and state."""
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    q, k, v, a, b, A_log, dt_bias, state, _, _, _ = make_batch([37], seed=1)
    g, beta = ref.gating(a, b, A_log, dt_bias)
    mine = state[:1].clone()
    out = ref.gated_delta_rule(q, k, v, g, beta, mine, torch.tensor([0, 37]), torch.tensor([0]))
    for fn in (hf.torch_recurrent_gated_delta_rule, hf.torch_chunk_gated_delta_rule):
        hf_out, hf_state = fn(
            q[None], k[None], v[None], g[None], beta[None], initial_state=state[:1].clone(),
            output_final_state=True, use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        torch.testing.assert_close(out, hf_out[0].double(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mine, hf_state.double(), atol=1e-5, rtol=1e-5)


cpu = pytest.mark.skipif(load_kernel() is None, reason="no C compiler")


@cpu
def test_the_c_kernel_equals_the_reference():
    batch = make_batch(LENGTHS, seed=2)
    want_out, want_state = reference(*batch)
    q, k, v, a, b, A_log, dt_bias, state, bounds, slots, initial = as_f32(batch)
    before = state.clone()
    out = cpu_rule(load_kernel(), q, k, v, a, b, A_log, dt_bias, state, bounds, slots, initial)
    assert_close_to(out, state, want_out, want_state)
    assert torch.equal(state[[1, 4]], before[[1, 4]])  # slots no sequence names


@cpu
def test_the_c_kernel_carries_a_prompt_across_pieces():
    """One 37-token prompt computed in pieces of 11, 1, 25 (chunked prefill, then as the
    engine would: each piece reads the state the last one wrote) equals it in one call."""
    batch = make_batch([37], seed=3)
    want_out, want_state = reference(*batch)
    q, k, v, a, b, A_log, dt_bias, state, _, slots, initial = as_f32(batch)
    outs, start = [], 0
    for piece in (11, 1, 25):
        rows = slice(start, start + piece)
        flag = initial if start == 0 else torch.ones_like(initial)
        outs.append(
            cpu_rule(
                load_kernel(), q[rows], k[rows], v[rows], a[rows], b[rows], A_log, dt_bias,
                state, torch.tensor([0, piece], dtype=torch.int32), slots, flag,
            )
        )  # fmt: skip
        start += piece
    assert_close_to(torch.cat(outs), state, want_out, want_state)


@cpu
def test_the_c_kernel_reads_tiled_value_heads_and_decode_rows_without_bounds():
    """tiled: value head h reads key head h % Hk (llama.cpp's GGUF order), as q and k
    repeated whole per value head do; no bounds: one row per sequence (a decode step)."""
    batch = make_batch([1, 1, 1], seed=6)
    q, k, v, a, b, A_log, dt_bias, state, bounds, slots, initial = batch
    ratio = HV // HK
    want_out, want_state = reference(
        q.repeat(1, ratio, 1), k.repeat(1, ratio, 1), v, a, b, A_log, dt_bias, state, bounds,
        slots, initial,
    )  # fmt: skip
    q, k, v, a, b, A_log, dt_bias, state, _, slots, initial = as_f32(batch)
    out = cpu_rule(
        load_kernel(), q, k, v, a, b, A_log, dt_bias, state, None, slots, initial, tiled=True
    )
    assert_close_to(out, state, want_out, want_state)


@cpu
def test_the_gated_norm_and_the_sigmoid_gate_equal_torch():
    """The DeltaNet's output norm gated by SiLU(z) (HF's float32 form) and the gated
    attention's sigmoid gate, their gates strided views of a projection's rows."""
    from minivllm.kernels.gated_delta_cpu import gated_rms_norm, sigmoid_gate

    g = torch.Generator().manual_seed(7)
    rows, heads, dim = 5, 3, 24
    x = torch.randn(rows, heads, dim, generator=g)
    proj = torch.randn(rows, heads * 2 * dim + 7, generator=g) * 3
    z = proj[:, 7 : 7 + heads * dim].view(rows, heads, dim)
    weight = torch.randn(dim, generator=g)
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    want = weight * normed * torch.nn.functional.silu(z)
    got = gated_rms_norm(load_kernel(), x.clone(), z, weight, 1e-6)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    gate = proj[:, 7:].view(rows, heads, 2 * dim)[..., dim:]  # [q_h | gate_h] per head
    got = sigmoid_gate(load_kernel(), x.clone(), gate)
    torch.testing.assert_close(got, x * torch.sigmoid(gate), atol=1e-6, rtol=1e-6)


@cpu
@pytest.mark.parametrize("lengths", [LENGTHS, [1, 1, 1]], ids=["prompts", "decode"])
def test_the_c_kernel_norms_its_output_as_the_gated_norm_does(lengths):
    """The rule with the output norm in the same call (the layer's path) gives the rule's
    output then gated_rms_norm's, bit for bit, and the same state; z a strided view of a
    projection's rows, as the layer's."""
    from minivllm.kernels.gated_delta_cpu import gated_rms_norm

    q, k, v, a, b, A_log, dt_bias, state, bounds, slots, initial = as_f32(
        make_batch(lengths, seed=8)
    )
    bounds = None if lengths == [1, 1, 1] else bounds
    g = torch.Generator().manual_seed(9)
    proj = torch.randn(q.shape[0], HV * DV + 5, generator=g) * 3
    z = proj[:, 5:].view(q.shape[0], HV, DV)
    weight = torch.randn(DV, generator=g)
    args = (q, k, v, a, b, A_log, dt_bias)
    plain_state, fused_state = state.clone(), state.clone()
    plain = cpu_rule(load_kernel(), *args, plain_state, bounds, slots, initial)
    plain = gated_rms_norm(load_kernel(), plain, z, weight, 1e-6)
    fused = cpu_rule(
        load_kernel(), *args, fused_state, bounds, slots, initial, norm_gate=z,
        norm_weight=weight, eps=1e-6,
    )  # fmt: skip
    assert torch.equal(fused, plain)
    assert torch.equal(fused_state, plain_state)
    with pytest.raises(ValueError, match="both"):
        cpu_rule(load_kernel(), *args, state, bounds, slots, initial, norm_gate=z)


def test_the_c_kernel_refuses_heads_that_are_not_contiguous():
    lib = load_kernel()
    if lib is None:
        pytest.skip("no C compiler")
    q, k, v, a, b, A_log, dt_bias, state, bounds, slots, initial = as_f32(make_batch([3], 4))
    with pytest.raises(ValueError, match="contiguous heads"):
        cpu_rule(lib, q.transpose(1, 2), k, v, a, b, A_log, dt_bias, state, bounds, slots)


triton = pytest.importorskip("triton")
from minivllm.kernels import triton_gated_delta  # noqa: E402

from .test_triton_attention import DEVICES  # noqa: E402


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "recurrent"])
def test_the_triton_kernels_equal_the_reference(device, chunked):
    batch = make_batch(LENGTHS, seed=5)
    want_out, want_state = reference(*batch)
    q, k, v, a, b, A_log, dt_bias, state, bounds, slots, initial = as_f32(batch, device)
    before = state.clone()
    out = triton_gated_delta.gated_delta_rule(
        q, k, v, a, b, A_log, dt_bias, state, bounds, slots, initial, chunked=chunked
    )
    assert_close_to(out, state, want_out, want_state)
    assert torch.equal(state[[1, 4]], before[[1, 4]])


@pytest.mark.parametrize("device", DEVICES)
def test_the_triton_decode_skips_padded_rows(device):
    """A CUDA graph's batch padded with rows of slot -1: they write no state."""
    batch = make_batch([1, 1], seed=6)
    want_out, want_state = reference(*batch)
    q, k, v, a, b, A_log, dt_bias, state, bounds, slots, initial = as_f32(batch, device)
    pad = lambda x: torch.cat([x, x[-1:]])  # noqa: E731
    q, k, v, a, b = (pad(x) for x in (q, k, v, a, b))
    bounds = torch.cat([bounds, bounds[-1:] + 1])
    slots = torch.cat([slots, slots.new_tensor([-1])])
    initial = torch.cat([initial, initial[-1:]])
    out = triton_gated_delta.gated_delta_rule(
        q, k, v, a, b, A_log, dt_bias, state, bounds, slots, initial, chunked=False
    )
    assert_close_to(out[:2], state, want_out, want_state)
