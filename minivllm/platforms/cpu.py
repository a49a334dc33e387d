"""The CPU: float32 unless the CPU computes bf16 natively, C-kernel attention, gloo, a KV
cache of ``kv_cache_memory_bytes`` (MINIVLLM_CPU_KVCACHE_SPACE GiB when not given), malloc
kept from returning memory, weights packed for oneDNN."""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import mmap
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from minivllm import envs
from minivllm.platforms.interface import Platform
from minivllm.utils.huge_pages import huge_page_bytes

if TYPE_CHECKING:
    from minivllm.config import CacheConfig

logger = logging.getLogger(__name__)


@functools.cache
def cpu_has_native_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_model_name(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's model name ("AMD EPYC 9654 96-Core Processor"); its architecture where
    cpuinfo names no model (most ARM kernels)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    return value.strip()
    except OSError:
        pass
    return f"{os.uname().machine} CPU"


def cpu_kv_cache_bytes_default() -> int:
    """MINIVLLM_CPU_KVCACHE_SPACE (or VLLM_CPU_KVCACHE_SPACE) GiB, in bytes; 4 GiB if unset."""
    return int(envs.MINIVLLM_CPU_KVCACHE_SPACE * (1 << 30))


# mallopt parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4


def reuse_freed_memory() -> None:
    """Make glibc's malloc keep freed memory for reuse instead of returning it to the OS.

    By default every allocation over 32 MiB (batch-256 logits are 50 MB) is a fresh mmap
    whose pages the kernel zero-fills on first touch: about 18 ms per 50 MB, every step.
    With mmap off and a high trim threshold, such blocks come from the heap and are reused.
    MINIVLLM_CPU_REUSE_FREED_MEMORY=0 leaves malloc alone; so does a libc other than glibc.
    """
    if not envs.MINIVLLM_CPU_REUSE_FREED_MEMORY:
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_MAX, 0)
        libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30)
    except (OSError, AttributeError):
        logger.debug("not glibc: malloc left as it is")


class CpuPlatform(Platform):
    device_type = "cpu"
    dist_backend = "gloo"
    ray_device_key = "CPU"
    kv_cache_usage_label = "KV cache usage"
    supported_quantization = ("gguf",)
    attn_backend = "minivllm.attention.cpu.CPUAttentionBackend"
    host_is_device = True

    def device_name(self) -> str:
        return cpu_model_name()

    def auto_dtype(self, config_dtype: str) -> str:
        # vLLM's rule, except that a CPU without native bf16 runs float32.
        return "bfloat16" if cpu_has_native_bf16() and config_dtype == "bfloat16" else "float32"

    def default_kv_cache_memory_bytes(self) -> int:
        return cpu_kv_cache_bytes_default()

    def available_kv_cache_memory(
        self, cache_config: CacheConfig, profile_run: Callable[[], int], min_bytes: int
    ) -> int:
        # A fixed size: host memory is not the engine's alone to measure and fill.
        if cache_config.kv_cache_memory_bytes is not None:
            return cache_config.kv_cache_memory_bytes
        return cpu_kv_cache_bytes_default()

    def zeros(
        self, shape: tuple[int, ...], dtype: torch.dtype, huge_pages: bool = False
    ) -> torch.Tensor:
        # Anonymous mmap'd pages read as zero and are zero-filled by the kernel on first
        # touch: nothing is written at start-up (torch.zeros wrote 4 GiB: 1.6 s here), and
        # a block's pages become resident when it is first used. (Faulting them all in on
        # a background thread cost the first request 1.5-4 s on 2 cores: not done.)
        count = math.prod(shape)
        if count == 0:
            return torch.zeros(shape, dtype=dtype)
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        # A Gated DeltaNet's decode reads and writes every running request's state (1 MB a
        # layer at Qwen3.5-0.8B's sizes) once a step (Zen 4, the rule over 18 layers' states
        # from memory: 0.90-0.94x the time in huge pages).
        if huge_pages and (pages := huge_page_bytes(nbytes)) is not None:
            return pages.view(dtype).view(shape)
        pages = mmap.mmap(-1, nbytes)
        return torch.frombuffer(pages, dtype=dtype, count=count).view(shape)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        # torch's CPU argmax over a row of a vocabulary (49k floats) takes ~100 us, numpy's
        # ~6: 1% of a small model's decode step. The same rule on ties and NaNs (the first).
        if logits.dtype != torch.float32:
            return logits.argmax(dim=-1)
        return torch.from_numpy(logits.numpy().argmax(axis=-1))

    def init_device(self, rank: int) -> None:
        reuse_freed_memory()
        self._auto_threads = None
        if (
            envs.MINIVLLM_CPU_THREADS_FOLLOW_LOAD
            and envs.MINIVLLM_CPU_OMP_THREADS_BIND == "auto"
            and "OMP_NUM_THREADS" not in os.environ
        ):
            from minivllm.platforms.cpu_threads import AutoThreads

            self._auto_threads = AutoThreads(torch.get_num_threads())

    def before_step(self) -> None:
        if getattr(self, "_auto_threads", None) is not None:
            self._auto_threads.update()

    def release_free_memory(self) -> None:
        # glibc keeps freed heap memory in its arenas: malloc_trim hands it back.
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass

    def runs_c_kernels(self, dtype: torch.dtype) -> bool:
        return dtype == torch.float32

    def packs_dense_linear_weights(self, dtype: torch.dtype) -> bool:
        # oneDNN's blocked layout (MINIVLLM_CPU_PACKED_LINEAR=0: plain F.linear).
        return (
            dtype == torch.float32
            and torch.backends.mkldnn.is_available()
            and envs.MINIVLLM_CPU_PACKED_LINEAR
        )
