"""NVIDIA GPUs: bfloat16 (float16 where the card lacks it), the Triton attention backend,
NCCL, a KV cache sized by a profiling pass."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from minivllm.platforms.interface import Platform

if TYPE_CHECKING:
    from minivllm.config import CacheConfig

logger = logging.getLogger(__name__)

GiB = 1 << 30


def kv_cache_budget(
    total: int,
    utilization: float,
    weights: int,
    peak_activations: int,
    non_torch: int,
    min_bytes: int,
) -> int:
    """vLLM V1's rule: the KV cache gets what ``utilization`` of the card's ``total`` bytes
    leaves after the weights, the activations' peak in the profiling pass, and the memory
    outside torch's allocator (CUDA context, NCCL, cuBLAS). ValueError when that is less
    than ``min_bytes`` (one request of max_model_len tokens)."""
    allowed = int(total * utilization)
    budget = allowed - weights - peak_activations - non_torch
    if budget < max(min_bytes, 1):
        left, short, fix = "nothing", "", ""
        if budget > 0:
            left = f"{budget / GiB:.2f} GiB"
            need = f"{min_bytes / GiB:.3f} GiB"
            short = f", less than one request of max_model_len tokens needs ({need})"
            fix = "lower max_model_len, or "
        raise ValueError(
            f"gpu_memory_utilization={utilization} allows {allowed / GiB:.2f} GiB of the "
            f"GPU's {total / GiB:.2f} GiB; the weights take {weights / GiB:.2f} GiB, the "
            f"peak activations {peak_activations / GiB:.2f} GiB and memory outside torch "
            f"{non_torch / GiB:.2f} GiB, which leaves {left} for the KV cache{short}. Raise "
            f"gpu_memory_utilization, or {fix}lower max_num_seqs or max_num_batched_tokens "
            "(smaller activations)."
        )
    return budget


class CudaPlatform(Platform):
    device_type = "cuda"
    dist_backend = "nccl"
    ray_device_key = "GPU"
    kv_cache_usage_label = "GPU KV cache usage"
    supported_quantization = ()
    attn_backend = "minivllm.attention.triton.TritonAttentionBackend"
    supports_cuda_graphs = True

    def pinned(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.pin_memory() if tensor.device.type == "cpu" else tensor

    def record_event(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record()
        return event

    def synchronize(self) -> None:
        torch.cuda.current_stream().synchronize()

    def release_free_memory(self) -> None:
        torch.cuda.empty_cache()

    def runs_triton_layer_kernels(self) -> bool:
        return True

    def device_name(self) -> str:
        return torch.cuda.get_device_name()

    def auto_dtype(self, config_dtype: str) -> str:
        # vLLM's rule: a float16 checkpoint stays float16, all else runs bfloat16. Emulated
        # bf16 (before Ampere) does not count: it is slow and vLLM refuses it.
        if config_dtype == "float16" or not torch.cuda.is_bf16_supported(including_emulation=False):
            return "float16"
        return "bfloat16"

    def available_kv_cache_memory(
        self, cache_config: CacheConfig, profile_run: Callable[[], int], min_bytes: int
    ) -> int:
        if cache_config.kv_cache_memory_bytes is not None:
            return cache_config.kv_cache_memory_bytes
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        weights = torch.cuda.memory_allocated()  # and whatever else the load left allocated
        profile_kv = profile_run()
        torch.cuda.synchronize()
        # The profiling pass's temporary KV cache is in the peak, but freed for the real one.
        activations = torch.cuda.max_memory_allocated() - weights - profile_kv
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        non_torch = max(total - free - torch.cuda.memory_reserved(), 0)
        budget = kv_cache_budget(
            total,
            cache_config.gpu_memory_utilization,
            weights,
            activations,
            non_torch,
            min_bytes,
        )
        logger.info(
            "Memory profiling: weights %.2f GiB, peak activations %.2f GiB, non-torch "
            "%.2f GiB; KV cache %.2f GiB (gpu_memory_utilization=%s of %.2f GiB).",
            weights / GiB,
            activations / GiB,
            non_torch / GiB,
            budget / GiB,
            cache_config.gpu_memory_utilization,
            total / GiB,
        )
        return budget

    def init_device(self, rank: int) -> None:
        torch.cuda.set_device(rank % torch.cuda.device_count())
