"""GGUF blocks to float32 in torch, on the device that holds the bytes.

A GGUF tensor travels to the accelerator as its blocks (4-6x smaller than float32) and is
dequantized there with bit operations and views, whole tensors at once (a chunk of blocks
at a time, to bound the temporaries). The arithmetic is gguf.quants' (the same products
and sums in the same order, no fused multiply-adds), so the floats equal
``gguf.quants.dequantize``'s bit for bit, on the CPU as on a GPU.

Every type of the usual model files is here: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1,
Q8_0, the K-quants Q2_K to Q6_K, IQ4_NL and IQ4_XS. The other IQ types (lattice codebooks)
are not: ``supports`` says which, and the loader dequantizes those with gguf's numpy code.

Layouts, a block's bytes in order (f16 = one float16; "4-bit" fields are packed low
nibble first, i.e. weight j of a run in the low nibble, weight j + run in the high one):
- Q4_0: f16 d, 16 bytes of 4-bit q; w = d * (q - 8)
- Q4_1: f16 d, f16 m, 16 bytes of 4-bit q; w = d * q + m
- Q5_0: f16 d, 4 bytes of high bits (bit j of the little-endian word for weight j),
  16 bytes of low nibbles; w = d * (q - 16)
- Q5_1: f16 d, f16 m, then as Q5_0; w = d * q + m
- Q8_0: f16 d, 32 int8; w = d * q
- K-quants: 256 weights in 16 or 8 sub-blocks, each with its own 4-, 6- or 8-bit scale
  (and minimum), see each function.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

T = GGMLQuantizationType

# Weights dequantized per step: bounds the temporaries (a few uint8 and float32 copies of
# a chunk) to a few MB however large the tensor. On the CPU 2^18-2^19 runs fastest (the
# temporaries stay in cache; 2^21 is ~1.7x slower); a GPU pays ~20 launches a chunk.
CHUNK_WEIGHTS = 1 << 19

# IQ4_NL's and IQ4_XS's 16 non-linear levels.
_IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def supports(qtype: int) -> bool:
    """Whether ``dequantize`` takes this GGML type."""
    return qtype in _DEQUANTIZERS


def dequantize(raw: torch.Tensor, qtype: int, chunk_weights: int = CHUNK_WEIGHTS) -> torch.Tensor:
    """``raw``: uint8 [..., bytes] of whole blocks -> float32 [..., weights], on raw's device.

    F32 comes back as a view of ``raw`` (no copy); every other type as a new tensor, filled
    ``chunk_weights`` weights (rounded to whole blocks) at a time.
    """
    if qtype not in _DEQUANTIZERS:
        raise NotImplementedError(f"GGML type {qtype} has no torch dequantizer")
    if raw.dtype != torch.uint8:
        raise TypeError(f"expected uint8 blocks, got {raw.dtype}")
    block, size = GGML_QUANT_SIZES[T(qtype)]
    if raw.dim() == 0 or raw.shape[-1] % size:
        raise ValueError(f"{tuple(raw.shape)} bytes are not whole blocks of {size} bytes")
    shape = (*raw.shape[:-1], raw.shape[-1] // size * block)
    raw = raw.contiguous()
    if qtype == T.F32:  # no copy
        return _f32_weights(raw).view(shape)
    blocks = raw.view(-1, size)
    out = torch.empty(blocks.shape[0], block, dtype=torch.float32, device=raw.device)
    step = max(1, chunk_weights // block)
    fn = _DEQUANTIZERS[qtype]
    for start in range(0, blocks.shape[0], step):
        out[start : start + step] = fn(blocks[start : start + step])
    return out.view(shape)


# ------------------------------------------------------------------ helpers


def _f16(blocks: torch.Tensor, start: int, count: int = 1) -> torch.Tensor:
    """``count`` float16 fields from byte ``start`` of each block, as float32 [n, count]."""
    field = blocks[:, start : start + 2 * count].contiguous()
    return field.view(torch.float16).float()


def _fields(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Bytes [..., m] -> their ``bits``-wide fields [..., 8 // bits, m], lowest bits first.

    Shifted as int32 words, four bytes at a time: torch's uint8 shifts are not vectorized
    on the CPU (ten times slower than int32 ones).
    """
    m = packed.shape[-1]
    if m % 4:
        packed = F.pad(packed, (0, -m % 4))
    words = packed.contiguous().view(torch.int32)
    mask = 0x01010101 * ((1 << bits) - 1)
    # A word's top byte takes the sign bits, but they land above the mask.
    fields = [(words >> shift) & mask for shift in range(0, 8, bits)]
    return torch.stack(fields, dim=-2).view(torch.uint8)[..., :m]


def _levels(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


# ------------------------------------------------------------------ float types


def _f32_weights(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.view(torch.float32)


def _f16_weights(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.view(torch.float16).float()


def _bf16_weights(blocks: torch.Tensor) -> torch.Tensor:
    # bfloat16 is the top half of a float32: shift its bits into place.
    return (blocks.view(torch.int16).to(torch.int32) << 16).view(torch.float32)


# ------------------------------------------------------------------ 32-weight blocks


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    q = _fields(blocks[:, 2:], 4).reshape(-1, 32)
    return _f16(blocks, 0) * (q.to(torch.int8) - 8).float()


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = _f16(blocks, 0, 2).unbind(1)
    q = _fields(blocks[:, 4:], 4).reshape(-1, 32).float()
    return d[:, None] * q + m[:, None]


def _five_bit(blocks: torch.Tensor, high_at: int) -> torch.Tensor:
    """Q5_0/Q5_1's quants (0..31): 4 bytes of high bits at ``high_at``, then the nibbles."""
    high = _fields(blocks[:, high_at : high_at + 4], 1).transpose(1, 2).reshape(-1, 32)
    low = _fields(blocks[:, high_at + 4 :], 4).reshape(-1, 32)
    return low | (high << 4)


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    q = _five_bit(blocks, 2)
    return _f16(blocks, 0) * (q.to(torch.int8) - 16).float()


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = _f16(blocks, 0, 2).unbind(1)
    q = _five_bit(blocks, 4).float()
    return d[:, None] * q + m[:, None]


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return _f16(blocks, 0) * blocks[:, 2:].view(torch.int8).float()


def _iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    q = _fields(blocks[:, 2:], 4).reshape(-1, 32)
    return _f16(blocks, 0) * _levels(_IQ4_LEVELS, blocks.device)[q.long()]


# ------------------------------------------------------------------ K-quants (256 weights)


def _q2_k(blocks: torch.Tensor) -> torch.Tensor:
    # 16 scale bytes (low nibble: scale, high: minimum, per 16 weights), 64 bytes of 2-bit
    # quants (two runs of 128: bits 2i..2i+1 of byte j is weight 32i + j), f16 d, f16 dmin.
    n = blocks.shape[0]
    scales = blocks[:, :16]
    d, dmin = _f16(blocks, 80, 2).unbind(1)
    dl = (d[:, None] * (scales & 0xF).float()).view(n, 16, 1)
    ml = (dmin[:, None] * (scales >> 4).float()).view(n, 16, 1)
    q = _fields(blocks[:, 16:80].reshape(n, 2, 32), 2).reshape(n, 16, 16).float()
    return (dl * q - ml).view(n, 256)


def _q3_k(blocks: torch.Tensor) -> torch.Tensor:
    # 32 bytes of high bits (bit i of byte j: weight 32i + j; a set bit means no -4), 64
    # bytes of 2-bit quants as Q2_K, 12 bytes of 16 6-bit scales biased by 32, f16 d.
    n = blocks.shape[0]
    packed = blocks[:, 96:108]
    low = _fields(packed[:, :8], 4).reshape(n, 16)  # scale i: nibble i // 8 of byte i % 8
    high = _fields(packed[:, 8:], 2).reshape(n, 16)  # scale i: bits of byte 8 + i % 4
    scales = ((low | (high << 4)).to(torch.int8) - 32).float()
    dl = (_f16(blocks, 108) * scales).view(n, 16, 1)
    q = _fields(blocks[:, 32:96].reshape(n, 2, 32), 2).reshape(n, 16, 16)
    missing = (_fields(blocks[:, :32], 1).reshape(n, 16, 16) ^ 1) << 2
    return (dl * (q.to(torch.int8) - missing.to(torch.int8)).float()).view(n, 256)


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit minimums, as float32.

    Bytes 0-3 hold scales 0-3 (low 6 bits), bytes 4-7 minimums 0-3; bytes 8-11 hold the
    low 4 bits of scales 4-7 (low nibble) and minimums 4-7 (high nibble), whose top 2 bits
    are the top bits of bytes 0-3 and 4-7.
    """
    d, m, md = packed.view(-1, 3, 4).unbind(1)
    scales = torch.cat([d & 0x3F, (md & 0xF) | ((d >> 2) & 0x30)], dim=-1)
    mins = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return scales.float(), mins.float()


def _k_quant(blocks: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K: f16 d, f16 dmin, 12 scale bytes; w = d * scale * q - dmin * min per 32."""
    n = blocks.shape[0]
    d, dmin = _f16(blocks, 0, 2).unbind(1)
    scales, mins = _k_scales(blocks[:, 4:16])
    dl = (d[:, None] * scales).view(n, 8, 1)
    ml = (dmin[:, None] * mins).view(n, 8, 1)
    return (dl * q.float() - ml).view(n, 256)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    # 128 bytes of nibbles, by 32: the low nibbles are one sub-block, the high the next.
    n = blocks.shape[0]
    return _k_quant(blocks, _fields(blocks[:, 16:].reshape(n, 4, 32), 4).reshape(n, 8, 32))


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    # 32 bytes of high bits (bit i of byte j: weight 32i + j), then Q4_K's nibbles.
    n = blocks.shape[0]
    high = _fields(blocks[:, 16:48], 1)
    low = _fields(blocks[:, 48:].reshape(n, 4, 32), 4).reshape(n, 8, 32)
    return _k_quant(blocks, low | (high << 4))


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    # 128 bytes of low nibbles (two runs of 64 bytes: low nibbles, then high ones), 64 bytes
    # of high 2-bit pairs (two runs of 32 bytes, four fields each), 16 int8 scales, f16 d.
    n = blocks.shape[0]
    low = _fields(blocks[:, :128].reshape(n, 2, 64), 4).reshape(n, 8, 32)
    high = _fields(blocks[:, 128:192].reshape(n, 2, 32), 2).reshape(n, 8, 32)
    q = ((low | (high << 4)).to(torch.int8) - 32).view(n, 16, 16).float()
    scales = blocks[:, 192:208].view(torch.int8).float()
    dl = (_f16(blocks, 208) * scales).view(n, 16, 1)
    return (dl * q).view(n, 256)


def _iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    # f16 d, a 16-bit word of the 8 scales' top 2 bits (scale i: bits 2i..2i+1), 4 bytes of
    # their low nibbles (scale i: nibble i % 2 of byte i // 2), 128 bytes of IQ4_NL nibbles
    # per 32 weights (16 bytes each). Scales are biased by 32.
    n = blocks.shape[0]
    high = _fields(blocks[:, 2:4], 2).transpose(1, 2).reshape(n, 8)
    low = _fields(blocks[:, 4:8], 4).transpose(1, 2).reshape(n, 8)
    scales = ((low | (high << 4)).to(torch.int8) - 32).float()
    dl = (_f16(blocks, 0) * scales).view(n, 8, 1)
    q = _fields(blocks[:, 8:].reshape(n, 8, 16), 4).reshape(n, 8, 32)
    return (dl * _levels(_IQ4_LEVELS, blocks.device)[q.long()]).view(n, 256)


_DEQUANTIZERS: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {
    T.F32: _f32_weights,  # dequantize returns the view itself
    T.F16: _f16_weights,
    T.BF16: _bf16_weights,
    T.Q4_0: _q4_0,
    T.Q4_1: _q4_1,
    T.Q5_0: _q5_0,
    T.Q5_1: _q5_1,
    T.Q8_0: _q8_0,
    T.Q2_K: _q2_k,
    T.Q3_K: _q3_k,
    T.Q4_K: _q4_k,
    T.Q5_K: _q5_k,
    T.Q6_K: _q6_k,
    T.IQ4_NL: _iq4_nl,
    T.IQ4_XS: _iq4_xs,
}
