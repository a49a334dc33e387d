"""The KV cache's element types (``--kv-cache-dtype``): what a cache row of one token and KV
head holds, and torch's reference for writing and reading it.

- ``auto``: the model's dtype (float32 on most CPUs).
- ``fp8`` / ``fp8_e4m3``: float8 e4m3fn, scale 1 (vLLM's default without calibrated
  scales), saturated at +-448; ``fp8_e5m2``: float8 e5m2, scale 1.
- ``int8``: symmetric int8 with one float32 scale per (token, KV head), amax / 127, kept in
  the 4 bytes after the head's D values (a row of D + 4 bytes, ~1.06 bytes a value for
  head_dim 64, like llama.cpp's q8_0). Chosen for the CPU kernel: a key block's scores are
  the integers' dot products times one vector of 16 scales, a value's scale folds into its
  softmax weight, so the inner loops are a widening load and an FMA, as for float32; the
  per-row scale keeps outlier heads from costing the other heads their precision. Keys are
  stored rotated (``rotate_keys``, attention/kv_rotation.py): outlier key channels (Qwen2's
  k bias) would otherwise cost a row's other channels their levels.

A quantized cache is a uint8 tensor in the backend's usual shape with head_dim widened to
``row_width(head_dim)``; the backends know the byte layout inside a row and a block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minivllm.config import KV_CACHE_DTYPES


@dataclass(frozen=True)
class KVCacheFormat:
    name: str  # "auto", "int8", "fp8_e4m3" or "fp8_e5m2" (aliases resolved)
    code: int  # the C kernel's kv_type: 0 float32, 1 int8, 2 e4m3, 3 e5m2
    fp8_dtype: torch.dtype | None = None  # the torch float8 type of an fp8 cache

    @property
    def quantized(self) -> bool:
        return self.name != "auto"

    @property
    def rotate_keys(self) -> bool:
        """Whether keys are stored (and queries read) in kv_rotation's rotated basis: int8's
        one scale per row needs an outlier channel spread over the row; fp8 (a float, its
        error relative per value) does not."""
        return self.name == "int8"

    @property
    def scale_bytes(self) -> int:
        """Bytes after a (token, KV head)'s D values: int8's float32 scale."""
        return 4 if self.name == "int8" else 0

    def row_width(self, head_dim: int) -> int:
        """Elements of one (token, KV head) row of the cache."""
        return head_dim + self.scale_bytes

    def storage_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The cache tensor's dtype."""
        return torch.uint8 if self.quantized else model_dtype


_FORMATS = {
    "auto": KVCacheFormat("auto", 0),
    "int8": KVCacheFormat("int8", 1),
    "fp8_e4m3": KVCacheFormat("fp8_e4m3", 2, torch.float8_e4m3fn),
    "fp8_e5m2": KVCacheFormat("fp8_e5m2", 3, torch.float8_e5m2),
}
_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def kv_cache_format(name: str) -> KVCacheFormat:
    """The format a ``--kv-cache-dtype`` value names (``fp8`` is ``fp8_e4m3``, as in vLLM)."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}."
        )
    return _FORMATS["fp8_e4m3" if name == "fp8" else name]


def quantize_rows(x: torch.Tensor, fmt: KVCacheFormat) -> torch.Tensor:
    """[..., D] float -> [..., row_width(D)] uint8 rows: the reference of the kernels' write
    (int8: round(x * (127 / amax)) and the scale amax / 127 after; fp8: saturated, rounded to
    nearest even)."""
    x = x.float()
    if fmt.fp8_dtype is not None:
        limit = _FP8_MAX[fmt.fp8_dtype]
        return x.clamp(-limit, limit).to(fmt.fp8_dtype).view(torch.uint8)
    amax = x.abs().amax(dim=-1, keepdim=True)
    # A true division (torch's 127.0 / t is 127 * reciprocal(t), a rounding away from C's).
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(x * inv).clamp(-127, 127).to(torch.int8).view(torch.uint8)
    scale = (amax * (1 / 127)).contiguous().view(torch.uint8)  # [..., 4] bytes
    return torch.cat([q, scale], dim=-1)


def dequantize_rows(rows: torch.Tensor, fmt: KVCacheFormat, head_dim: int) -> torch.Tensor:
    """[..., row_width(D)] uint8 -> [..., D] float32 (the torch path's read; the kernels
    read rows in place)."""
    if fmt.fp8_dtype is not None:
        return rows[..., :head_dim].view(fmt.fp8_dtype).float()
    values = rows[..., :head_dim].view(torch.int8).float()
    scale = rows[..., head_dim : head_dim + 4].contiguous().view(torch.float32)
    return values * scale
