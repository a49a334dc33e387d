"""NVIDIA GPUs: bfloat16 (float16 where the card lacks it), the Triton attention backend,
NCCL, a KV cache sized by a profiling pass."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from minivllm.platforms.interface import Platform

if TYPE_CHECKING:
    from minivllm.config import CacheConfig


class CudaPlatform(Platform):
    device_type = "cuda"
    dist_backend = "nccl"
    ray_device_key = "GPU"
    kv_cache_usage_label = "GPU KV cache usage"
    supported_quantization = ()
    attn_backend = "minivllm.attention.triton.TritonAttentionBackend"

    def auto_dtype(self, config_dtype: str) -> str:
        # vLLM's rule: a float16 checkpoint stays float16, all else runs bfloat16. Emulated
        # bf16 (before Ampere) does not count: it is slow and vLLM refuses it.
        if config_dtype == "float16" or not torch.cuda.is_bf16_supported(including_emulation=False):
            return "float16"
        return "bfloat16"

    def available_kv_cache_memory(self, cache_config: CacheConfig) -> int:
        if cache_config.kv_cache_memory_bytes is not None:
            return cache_config.kv_cache_memory_bytes
        raise NotImplementedError(
            "Sizing the KV cache from gpu_memory_utilization (a profiling forward pass) is "
            "not implemented yet: give kv_cache_memory_bytes."
        )

    def init_device(self, rank: int) -> None:
        torch.cuda.set_device(rank % torch.cuda.device_count())
