"""A worker owns a device: it loads the model, sizes and allocates the KV cache, and runs steps.

With tensor parallelism there is one worker per rank, each in its own process; every one
gets the same calls, loads its own slice of the weights and caches its own KV heads.
"""

from __future__ import annotations

import contextlib
import logging
import math

import torch

from minivllm.config import VllmConfig
from minivllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from minivllm.distributed.parallel_state import TPGroup, destroy_tp_group, init_tp_group
from minivllm.model.layers.quantization.gguf import weight_bytes
from minivllm.model.loader import iter_weights
from minivllm.model.registry import resolve_model_class
from minivllm.model.weight_loading import process_weights_after_loading
from minivllm.platforms import get_platform
from minivllm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


class Worker:
    def __init__(
        self, config: VllmConfig, rank: int = 0, distributed_init_method: str | None = None
    ) -> None:
        """rank and distributed_init_method (tcp://host:port of rank 0's store) matter only
        with tensor_parallel_size > 1."""
        self.config = config
        self.platform = get_platform(config.device)
        self.model_config = config.model_config
        self.rank = rank
        self.distributed_init_method = distributed_init_method
        self.tp = TPGroup()
        self.dtype = getattr(torch, self.model_config.dtype)
        self.kv_cache_dtype = self.platform.kv_cache_dtype(self.dtype)
        self.model: torch.nn.Module | None = None
        self.model_runner: ModelRunner | None = None
        self.kv_caches: list[torch.Tensor] = []
        torch.manual_seed(self.model_config.seed)

    def init_device(self) -> None:
        """Set the device up and join the tensor-parallel group (the platform's backend)."""
        self.platform.init_device(self.rank)
        size = self.config.parallel_config.tensor_parallel_size
        if size > 1:
            self.tp = init_tp_group(
                self.rank, size, self.distributed_init_method, self.platform.dist_backend
            )

    def load_model(self) -> None:
        hf_config = self.model_config.hf_config
        model_cls = resolve_model_class(hf_config)
        block_size = self.config.cache_config.block_size
        self.attn_backend = self.platform.create_attn_backend(block_size)
        # Parameters are created empty, in the target dtype, on the device (nothing is
        # allocated twice), and filled by the loader.
        with default_dtype(self.dtype), torch.device(self.platform.device):
            model = model_cls(
                hf_config, self.attn_backend, self.tp, quant_config=self.config.quant_config
            )
        quantization = self.model_config.quantization
        model.load_weights(iter_weights(self.model_config.model, self.dtype, quantization))
        process_weights_after_loading(model)
        self.weight_memory_bytes = weight_bytes(model)
        logger.info(
            "Model weights: %.1f MiB (quantization=%s).",
            self.weight_memory_bytes / (1 << 20),
            quantization or "none",
        )
        self.model = model.eval()
        self.model_runner = ModelRunner(
            self.model,
            block_size,
            self.model_config.vocab_size,
            self.tp,
            self.config.scheduler_config,
            attn_backend=self.attn_backend,
            enforce_eager=self.model_config.enforce_eager,
            device=self.platform.device,
        )

    def _kv_cache_shape(self, attn, num_blocks: int) -> tuple[int, ...]:
        block_size = self.config.cache_config.block_size
        return self.attn_backend.get_kv_cache_shape(
            num_blocks, block_size, attn.num_kv_heads, attn.head_dim
        )

    def kv_cache_bytes_per_block(self) -> int:
        elem = torch.tensor([], dtype=self.kv_cache_dtype).element_size()
        layers = self.model.attention_layers()
        return sum(math.prod(self._kv_cache_shape(a, 1)) for a in layers) * elem

    def get_weight_memory_bytes(self) -> int:
        """The bytes this rank's weights hold, packed copies included (set at load)."""
        return self.weight_memory_bytes

    def determine_available_memory(self) -> int:
        """Bytes this worker may give the KV cache (on CPU: the configured space)."""
        return self.platform.available_kv_cache_memory(self.config.cache_config)

    def determine_num_blocks(self) -> int:
        cache = self.config.cache_config
        per_block = self.kv_cache_bytes_per_block()
        num_blocks = self.determine_available_memory() // per_block
        max_len = self.model_config.max_model_len
        needed = -(-max_len // cache.block_size)
        if num_blocks < needed:
            need_gib = needed * per_block / (1 << 30)
            have_gib = self.determine_available_memory() / (1 << 30)
            raise ValueError(
                f"max_model_len={max_len} needs {need_gib:.3f} GiB of KV cache "
                f"({needed} blocks of {cache.block_size} tokens), but the KV cache has "
                f"{have_gib:.3f} GiB. Raise kv_cache_memory_bytes (or "
                "MINIVLLM_CPU_KVCACHE_SPACE) or lower max_model_len."
            )
        return num_blocks

    def initialize_kv_cache(self, num_blocks: int) -> None:
        block_size = self.config.cache_config.block_size
        self.kv_caches = []
        for attn in self.model.attention_layers():
            # Zeroed: padded reads multiply stale slots by zero weight, never by NaN.
            cache = torch.zeros(
                self._kv_cache_shape(attn, num_blocks),
                dtype=self.kv_cache_dtype,
                device=self.platform.device,
            )
            attn.kv_cache = cache
            self.kv_caches.append(cache)
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB)",
            num_blocks,
            block_size,
            num_blocks * self.kv_cache_bytes_per_block() / (1 << 30),
        )
        self.model_runner.capture_model()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)

    def shutdown(self) -> None:
        destroy_tp_group(self.tp)
