"""What a platform answers: the one place the engine asks about its device."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from minivllm import envs

if TYPE_CHECKING:
    from minivllm.attention.backend import AttentionBackend
    from minivllm.config import CacheConfig

_DTYPE_ALIASES = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp32": "float32"}
SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")


class Platform:
    """A device kind. Chosen once (``platforms.get_platform``); nothing outside
    ``platforms/`` asks which device it runs on, it asks the platform instead."""

    device_type: str  # torch's name: "cpu", "cuda"
    dist_backend: str  # torch.distributed backend between the tensor-parallel ranks
    ray_device_key: str  # the Ray resource each worker takes: "CPU", "GPU"
    kv_cache_usage_label: str  # how the statistics line names the KV cache's use
    supported_quantization: tuple[str, ...] = ()
    attn_backend: str  # dotted path of the attention backend class

    @property
    def device(self) -> torch.device:
        return torch.device(self.device_type)

    def device_name(self) -> str:
        """The hardware's model name, for benchmark reports."""
        return self.device_type

    # ------------------------------------------------------------------ dtypes

    def resolve_dtype(self, dtype: str, hf_config) -> str:
        """vLLM's dtype rules: aliases, then "auto" as this device decides from the config."""
        dtype = _DTYPE_ALIASES.get(dtype, dtype)
        if dtype == "auto":
            config_dtype = str(getattr(hf_config, "dtype", None) or "float32")
            return self.auto_dtype(config_dtype.replace("torch.", ""))
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"Unsupported dtype {dtype!r}: use auto, float32, bfloat16 or float16."
            )
        return dtype

    def auto_dtype(self, config_dtype: str) -> str:
        """The dtype "auto" means for a checkpoint saved in ``config_dtype``."""
        raise NotImplementedError

    def kv_cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return model_dtype

    # ------------------------------------------------------------------ attention, KV cache

    def get_attn_backend_cls(self) -> type[AttentionBackend]:
        """The attention backend class (MINIVLLM_ATTENTION_BACKEND's, else this device's),
        imported only when asked for."""
        chosen = envs.MINIVLLM_ATTENTION_BACKEND
        path = envs.ATTENTION_BACKENDS[chosen] if chosen else self.attn_backend
        module, _, name = path.rpartition(".")
        return getattr(importlib.import_module(module), name)

    def create_attn_backend(
        self, block_size: int, kv_cache_dtype: str = "auto"
    ) -> AttentionBackend:
        """The worker's backend instance, for a KV cache of ``block_size``-token blocks that
        holds ``kv_cache_dtype`` (see attention/kv_quant.py)."""
        return self.get_attn_backend_cls()(block_size, kv_cache_dtype=kv_cache_dtype)

    def default_kv_cache_memory_bytes(self) -> int | None:
        """The KV cache's size when the user gives none; None: measured at start-up."""
        return None

    def available_kv_cache_memory(
        self, cache_config: CacheConfig, profile_run: Callable[[], int], min_bytes: int
    ) -> int:
        """Bytes one worker may give its KV cache. A platform that measures calls
        ``profile_run`` (the worker's dummy step at the scheduler's limits; it returns the
        bytes of the temporary KV cache it held) and refuses less than ``min_bytes``."""
        raise NotImplementedError

    # ------------------------------------------------------------------ process, weights

    def init_device(self, rank: int) -> None:
        """Once per worker process, before the model is built."""

    def before_step(self) -> None:
        """Before each model step, in the thread that runs it (the CPU adjusts its thread
        count to the cores other processes leave free)."""

    def release_free_memory(self) -> None:
        """Give the memory of freed tensors back to the system (a dozing engine's KV
        cache), where the allocator keeps it otherwise."""

    def runs_c_kernels(self, dtype: torch.dtype) -> bool:
        """Whether tensors of this dtype on this device can go to the C kernels of
        ``kernels/`` (host memory, read through raw pointers)."""
        return False

    def runs_triton_layer_kernels(self) -> bool:
        """Whether this device's tensors go to the Triton layer kernels of
        ``kernels/triton_layers.py`` (RMS norm, SiLU-and-mul, RoPE) instead of torch ops."""
        return False

    def packs_dense_linear_weights(self, dtype: torch.dtype) -> bool:
        """Whether a dense linear layer repacks its weight once after loading for this device's
        GEMM (``UnquantizedLinearMethod.process_weights_after_loading`` asks)."""
        return False

    # ------------------------------------------------------------------ host and device

    # The device's memory is the host's: a tensor needs no copy to reach it, and results
    # are there as soon as an op returns (the CPU). Otherwise inputs travel through pinned
    # host buffers and outputs come back after a wait (``synchronize``).
    host_is_device: bool = False
    # Decode steps are captured as CUDA graphs at start-up (unless enforce_eager).
    supports_cuda_graphs: bool = False

    def pinned(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``, in pinned host memory if it is on the host and must travel to the
        device (a copy from pageable memory may wait for the device's queue)."""
        return tensor

    def zeros(
        self, shape: tuple[int, ...], dtype: torch.dtype, huge_pages: bool = False
    ) -> torch.Tensor:
        """A zero-filled tensor on the device, for the KV cache (large, mostly unused at
        first) and the state cache. ``huge_pages``: the kernels stream it front to back each
        step (a host may put it in transparent huge pages)."""
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's index of its largest value (the first on ties), [B] int64: the
        greedy draw."""
        return logits.argmax(dim=-1)

    def record_event(self):
        """A marker of the work queued so far (``.synchronize()`` waits for it); None where
        work is done when queued."""
        return None

    def synchronize(self) -> None:
        """Wait until the device has done all queued work."""

    def ray_actor_options(self) -> dict:
        """What each Ray worker actor reserves."""
        return {f"num_{self.ray_device_key.lower()}s": 1}
