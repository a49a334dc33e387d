"""The KV cache's element types (``--kv-cache-dtype``): what a cache row of one token and KV
head holds, and torch's reference for writing and reading it.

- ``auto``: the model's dtype (float32 on most CPUs).
- ``fp16k_int8v`` (``int8`` names it): keys in float16 (saturated at +-65504), values in
  symmetric int8 with one float32 scale per (token, KV head), amax / 127, in the 4 bytes
  after the head's D values: 3 D + 4 bytes a token and head, 2.6x a float32 cache's tokens
  at head_dim 64. Keys carry outlier channels in some models (Qwen2's k bias makes a few of
  a head's channels ~10-50x the others), which one scale a row cannot hold (int8 keys, even
  rotated, cost Qwen2.5-Coder-0.5B +1.4% perplexity); float16 keys hold the bar on both
  measured models (BENCHMARKS.md). The values' scale folds into each softmax weight, so the
  kernels' inner loops are a widening load and an FMA, as for float32. A block's keys and
  values are stored side by side (``block_major``: the cache tensor is allocated
  [num_blocks, 2, ...] and seen as [2, num_blocks, ...]), since the two differ in size.
- ``fp16k_e4m3v`` (``fp8`` and ``fp8_e4m3`` name it, vLLM's names) and ``fp16k_e5m2v``
  (``fp8_e5m2``): the same layout with float8 values (e4m3fn, e5m2) in place of int8, each
  row scaled by amax / the format's largest value (448, 57344), the scale after the row as
  int8's. fp8 keys with scale 1 (vLLM's CPU cache) missed the quality bar on both measured
  models (+1.1% / +2.7% perplexity); as for int8, the keys are what a model's outlier
  channels make hard, so they stay float16.
- ``int8k_int8v``: keys and values as int8 rows with their scales (D + 4 bytes each, 3.8x a
  float32 cache's tokens), each key channel first divided by its layer's fixed factor
  (``smooth_keys``, attention/kv_smoothing.py: the query multiplied by it, the scores
  unchanged) so that an outlier channel no longer takes the row's one scale. It holds the
  bar on both measured models (smoothed; rotated keys, as it stored before, missed it on
  Qwen2.5).
- ``e4m3k_e4m3v``, ``e5m2k_e5m2v``: keys and values in float8 with scale 1, saturated (what
  ``fp8`` stored before; 4x a float32 cache's tokens), below the quality bar.

A quantized cache is a uint8 tensor in the backend's usual shape with head_dim widened to
``row_width(head_dim)``; the backends know the byte layout inside a row and a block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minivllm.config import KV_CACHE_DTYPE_ALIASES, KV_CACHE_DTYPES


@dataclass(frozen=True)
class KVCacheFormat:
    name: str  # a layout's name (KV_CACHE_DTYPES less the aliases)
    # The C and Triton kernels' kv_type: 0 float32, 1 int8 keys and values, 2 e4m3, 3 e5m2,
    # 4 float16 keys and int8 values, 5 float16 keys and scaled e4m3 values, 6 the same with
    # e5m2.
    code: int
    fp8_dtype: torch.dtype | None = None  # the torch float8 type of the cache's fp8 rows

    @property
    def quantized(self) -> bool:
        return self.name != "auto"

    @property
    def fp16_keys(self) -> bool:
        """Keys in float16 beside 8-bit values with a scale a row (fp16k_*v)."""
        return self.name.startswith("fp16k_")

    @property
    def block_major(self) -> bool:
        """A block's keys and values stored side by side (AttentionBackend.new_kv_cache)."""
        return self.fp16_keys

    @property
    def smooth_keys(self) -> bool:
        """Whether keys are stored divided by their layer's per-channel factors (and queries
        read multiplied by them; kv_smoothing.py): int8 keys' one scale per row needs the
        outlier channels brought down; fp8 and float16 (floats, their error relative per
        value) do not."""
        return self.name == "int8k_int8v"

    @property
    def scale_bytes(self) -> int:
        """Bytes after an 8-bit row's D values: its float32 scale (none for fp8 with scale
        1)."""
        return 4 if self.name == "int8k_int8v" or self.fp16_keys else 0

    def row_width(self, head_dim: int) -> int:
        """Elements of one (token, KV head) row of the cache tensor's last axis: with
        fp16_keys, half of the key's and the value's bytes together (2 D + D + 4)."""
        if self.fp16_keys:
            return (3 * head_dim + 5) // 2
        return head_dim + self.scale_bytes

    def storage_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The cache tensor's dtype."""
        return torch.uint8 if self.quantized else model_dtype


_FORMATS = {
    "auto": KVCacheFormat("auto", 0),
    "int8k_int8v": KVCacheFormat("int8k_int8v", 1),
    "e4m3k_e4m3v": KVCacheFormat("e4m3k_e4m3v", 2, torch.float8_e4m3fn),
    "e5m2k_e5m2v": KVCacheFormat("e5m2k_e5m2v", 3, torch.float8_e5m2),
    "fp16k_int8v": KVCacheFormat("fp16k_int8v", 4),
    "fp16k_e4m3v": KVCacheFormat("fp16k_e4m3v", 5, torch.float8_e4m3fn),
    "fp16k_e5m2v": KVCacheFormat("fp16k_e5m2v", 6, torch.float8_e5m2),
}
_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
_FP16_MAX = 65504.0


def kv_cache_format(name: str) -> KVCacheFormat:
    """The format a ``--kv-cache-dtype`` value names (``int8`` is ``fp16k_int8v``, ``fp8``
    and ``fp8_e4m3`` ``fp16k_e4m3v``, ``fp8_e5m2`` ``fp16k_e5m2v``)."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}."
        )
    return _FORMATS[KV_CACHE_DTYPE_ALIASES.get(name, name)]


def quantize_rows(x: torch.Tensor, fmt: KVCacheFormat, keys: bool = False) -> torch.Tensor:
    """[..., D] float -> uint8 rows of keys (``keys``) or values: the reference of the
    kernels' write. int8: round(x * (127 / amax)) and the scale amax / 127 after, D + 4
    bytes; fp8 with scale 1: saturated, rounded to nearest even, D bytes; fp8 values with a
    scale: x * (top / amax) as fp8 (top: the format's largest value) and the scale amax /
    top after, D + 4 bytes; float16 keys: saturated, 2 D bytes."""
    x = x.float()
    if keys and fmt.fp16_keys:
        return x.clamp(-_FP16_MAX, _FP16_MAX).half().view(torch.uint8)
    if fmt.fp8_dtype is not None and not fmt.scale_bytes:
        limit = _FP8_MAX[fmt.fp8_dtype]
        return x.clamp(-limit, limit).to(fmt.fp8_dtype).view(torch.uint8)
    top = _FP8_MAX[fmt.fp8_dtype] if fmt.fp8_dtype is not None else 127.0
    amax = x.abs().amax(dim=-1, keepdim=True)
    # A true division (torch's 127.0 / t is 127 * reciprocal(t), a rounding away from C's).
    inv = torch.where(amax > 0, torch.full_like(amax, top) / amax, torch.zeros_like(amax))
    if fmt.fp8_dtype is not None:
        q = (x * inv).clamp(-top, top).to(fmt.fp8_dtype).view(torch.uint8)
    else:
        q = torch.round(x * inv).clamp(-127, 127).to(torch.int8).view(torch.uint8)
    scale = (amax * (1 / top)).contiguous().view(torch.uint8)  # [..., 4] bytes
    return torch.cat([q, scale], dim=-1)


def dequantize_rows(
    rows: torch.Tensor, fmt: KVCacheFormat, head_dim: int, keys: bool = False
) -> torch.Tensor:
    """quantize_rows' uint8 rows -> [..., D] float32 (the torch path's read; the kernels
    read rows in place)."""
    if keys and fmt.fp16_keys:
        return rows[..., : 2 * head_dim].contiguous().view(torch.float16).float()
    if fmt.fp8_dtype is not None and not fmt.scale_bytes:
        return rows[..., :head_dim].view(fmt.fp8_dtype).float()
    element = fmt.fp8_dtype or torch.int8
    values = rows[..., :head_dim].view(element).float()
    scale = rows[..., head_dim : head_dim + 4].contiguous().view(torch.float32)
    return values * scale
