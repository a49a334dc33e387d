"""The gated delta rule (Gated DeltaNet's linear attention: Qwen3-Next, Qwen3.5) in plain
torch: the reference the C and Triton kernels are tested against, and the path for tensors
no kernel takes.

Per value head the state S is a [Dk, Dv] matrix; each token t, with its key and query
L2-normalised (the query also scaled by Dk^-1/2), decays it and writes the part of v_t
that S does not already predict from k_t (the delta rule), then reads it with q_t:

    S = exp(g_t) S;   S += k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t

g_t = -exp(A_log) softplus(a_t + dt_bias) (log decay, <= 0) and beta_t = sigmoid(b_t) come
from the layer's a/b projections (``gating``). Value heads share key heads in groups
(value head h reads key head h // (Hv / Hk)).

Two forms of one function: ``recurrent`` steps token by token (a decode, or any prompt);
``chunked`` does a prompt's tokens in chunks of ``chunk_size``, each a few matrix
products (the UT transform of the DeltaNet paper), and steps only from chunk to chunk.

Batches are flat and without padding, as the engine's: tokens [T, ...] of several
sequences, ``query_start_loc`` [B + 1] their bounds, ``state_slots`` [B] where each keeps
its state in ``state`` [num_slots, Hv, Dk, Dv] (read unless ``has_initial_state`` says the
sequence starts here, then written back in place). A request's prompt cut into chunks by
the scheduler is carried across them exactly by that state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

L2_EPS = 1e-6  # FLA's and HF's epsilon in the q/k L2 norms


def gating(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, beta) [T, Hv] from the raw projections a, b [T, Hv] (float32 at least, as HF)."""
    dtype = torch.promote_types(a.dtype, torch.float32)
    g = -A_log.to(dtype).exp() * F.softplus(a.to(dtype) + dt_bias.to(dtype))
    return g, b.to(dtype).sigmoid()


def l2_normalized(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def gated_delta_rule(
    q: torch.Tensor,  # [T, Hk, Dk]
    k: torch.Tensor,  # [T, Hk, Dk]
    v: torch.Tensor,  # [T, Hv, Dv]
    g: torch.Tensor,  # [T, Hv] log decay
    beta: torch.Tensor,  # [T, Hv]
    state: torch.Tensor,  # [num_slots, Hv, Dk, Dv], updated in place
    query_start_loc: torch.Tensor,  # [B + 1]
    state_slots: torch.Tensor,  # [B]
    has_initial_state: torch.Tensor | None = None,  # [B] bool; None: every sequence has one
    chunk_size: int | None = None,  # None: the recurrent form
) -> torch.Tensor:
    """The output [T, Hv, Dv] (in v's dtype), computed in float32 (float64 for float64
    inputs); each sequence's final state written to its slot."""
    dtype = torch.promote_types(v.dtype, torch.float32)
    num_v_heads = v.shape[1]
    group = num_v_heads // k.shape[1]
    # [H, T, D] per value head, normalised once.
    q = l2_normalized(q.to(dtype)) * q.shape[-1] ** -0.5
    k = l2_normalized(k.to(dtype))
    q, k = (x.repeat_interleave(group, dim=1).transpose(0, 1) for x in (q, k))
    v = v.to(dtype).transpose(0, 1)
    g, beta = g.to(dtype).t(), beta.to(dtype).t()
    out = torch.empty_like(v)
    bounds = query_start_loc.tolist()
    for i, slot in enumerate(state_slots.tolist()):
        s, e = bounds[i], bounds[i + 1]
        fresh = has_initial_state is not None and not bool(has_initial_state[i])
        initial = torch.zeros_like(state[slot], dtype=dtype) if fresh else state[slot].to(dtype)
        if chunk_size is None:
            o, final = recurrent(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], initial)
        else:
            args = (q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], initial)
            o, final = chunked(*args, chunk_size)
        out[:, s:e] = o
        state[slot] = final.to(state.dtype)
    return out.transpose(0, 1).to(v.dtype)


def recurrent(q, k, v, g, beta, S) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence token by token: q, k [H, L, Dk] (normalised), v [H, L, Dv], g and beta
    [H, L], S [H, Dk, Dv] -> (out [H, L, Dv], final S)."""
    out = torch.empty_like(v)
    for t in range(q.shape[1]):
        kt = k[:, t, :, None]  # [H, Dk, 1]
        S = S * g[:, t, None, None].exp()
        delta = (v[:, t] - (S * kt).sum(1)) * beta[:, t, None]  # [H, Dv]
        S = S + kt * delta[:, None, :]
        out[:, t] = (S * q[:, t, :, None]).sum(1)
    return out, S


def chunked(q, k, v, g, beta, S, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``recurrent``'s result, a chunk of tokens at a time.

    Within a chunk, with G_i the cumulative log decay up to token i and D_ij =
    exp(G_i - G_j) for j <= i, the values each token writes, u, solve the unit
    lower-triangular system (I + tril(beta_i k_i.k_j D_ij, -1)) u = beta v - (that same
    system applied to) the old state's prediction; the chunk's outputs are the old state
    read with the decayed queries plus causal (q.k D) attention over u."""
    heads, length, _ = q.shape
    pad = -length % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))  # g 0, beta 0: padding writes nothing
    n = (length + pad) // chunk_size
    q, k, v = (x.reshape(heads, n, chunk_size, -1) for x in (q, k, v))
    g, beta = (x.reshape(heads, n, chunk_size) for x in (g, beta))
    cum = g.cumsum(-1)  # [H, n, C]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2) * decay).tril(-1)
    system = system + torch.eye(chunk_size, dtype=q.dtype, device=q.device)
    # u = T beta v and w = T (beta k exp(G)), T = system^-1: the values each token writes
    # if the chunk started from an empty state, and how much of the old state it reads.
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False)
    w = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False)
    attn = q @ k.transpose(-1, -2) * decay  # causal, with the diagonal
    q_decayed = q * cum.exp()[..., None]
    last = cum[..., -1]  # [H, n]
    k_to_end = k * (last[..., None] - cum).exp()[..., None]
    out = torch.empty_like(v)
    for c in range(n):
        v_new = u[:, c] - w[:, c] @ S
        out[:, c] = q_decayed[:, c] @ S + attn[:, c] @ v_new
        S = S * last[:, c, None, None].exp() + k_to_end[:, c].transpose(-1, -2) @ v_new
    return out.reshape(heads, n * chunk_size, -1)[:, :length], S
