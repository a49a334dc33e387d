"""A worker owns a device: it loads the model, sizes and allocates the KV cache, and runs steps.

With tensor parallelism there is one worker per rank, each in its own process; every one
gets the same calls, loads its own slice of the weights and caches its own KV heads. With
pipeline parallelism each stage's workers build, load and cache only the stage's layers
(``worker/pipeline_stage.py`` passes the activations between them).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import math
import time

import torch

from minivllm.config import VllmConfig
from minivllm.core.kv_cache_utils import KVCacheSpec
from minivllm.core.sched_output import AsyncModelRunnerOutput, ModelRunnerOutput, SchedulerOutput
from minivllm.distributed.parallel_state import (
    PPGroup,
    TPGroup,
    destroy_parallel_groups,
    init_parallel_groups,
)
from minivllm.model.layers.quantization import get_quantization_config
from minivllm.model.layers.quantization.base import weight_bytes
from minivllm.model.layers.state_cache import StateCache, state_bytes_per_slot
from minivllm.model.loader import iter_weights
from minivllm.model.loader.dummy import initialize_dummy_weights
from minivllm.model.registry import resolve_model_class
from minivllm.model.weight_loading import process_weights_after_loading
from minivllm.platforms import get_platform
from minivllm.sample.sampler import SamplingMetadata
from minivllm.worker.dummy_forward import calibrate_key_factors, dummy_forward
from minivllm.worker.model_runner import ModelRunner
from minivllm.worker.pipeline_stage import StageModel
from minivllm.worker.pooler import Pooler, classify_activation, score_activation

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
        with several workers (tensor_parallel_size x pipeline_parallel_size > 1)."""
        self.config = config
        self.platform = get_platform(config.device)
        self.model_config = config.model_config
        self.rank = rank
        self.distributed_init_method = distributed_init_method
        self.tp = TPGroup()
        self.pp = PPGroup()
        self.dtype = getattr(torch, self.model_config.dtype)
        self.kv_cache_dtype = self.platform.kv_cache_dtype(self.dtype)
        self.model: torch.nn.Module | None = None
        self.model_runner: ModelRunner | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.num_state_slots = 0  # a hybrid model's state cache (determine_num_blocks)
        self.state_cache: StateCache | None = None
        self.step_seconds = 0.0  # a pipeline stage's time in steps (get_stage_times)
        self.steps = 0  # and how many it ran
        torch.manual_seed(self.model_config.seed)

    def init_device(self) -> None:
        """Set the device up and join the tensor-parallel group and pipeline (the
        platform's backend)."""
        self.platform.init_device(self.rank)
        parallel = self.config.parallel_config
        if parallel.world_size > 1:
            self.tp, self.pp = init_parallel_groups(
                self.rank,
                parallel.tensor_parallel_size,
                parallel.pipeline_parallel_size,
                self.distributed_init_method,
                self.platform.dist_backend,
            )

    def load_model(self) -> None:
        hf_config = self.model_config.hf_config
        model_cls = resolve_model_class(hf_config)
        block_size = self.config.cache_config.block_size
        self.attn_backend = self.platform.create_attn_backend(
            block_size, self.config.cache_config.kv_cache_dtype
        )
        # Parameters are created empty, in the target dtype, on the device (nothing is
        # allocated twice), and filled by the loader.
        stage = {}
        if self.pp.size > 1:
            if not getattr(model_cls, "supports_pipeline_parallel", False):
                raise ValueError(
                    f"{model_cls.__name__} does not support pipeline parallelism: use "
                    "pipeline_parallel_size=1 (tensor parallelism may split it instead)."
                )
            stage = {"pp": self.pp}
            if self.attn_backend.kv_format.smooth_keys:
                raise ValueError(
                    "kv_cache_dtype int8k_int8v calibrates its keys with a forward through the "
                    "whole model at start-up, which one pipeline stage cannot run alone: use "
                    "pipeline_parallel_size=1 or another kv_cache_dtype."
                )
        with default_dtype(self.dtype), torch.device(self.platform.device):
            quant_config = get_quantization_config(self.model_config.quantization)
            model = model_cls(
                hf_config, self.attn_backend, self.tp, quant_config=quant_config, **stage
            )
        quantization = self.model_config.quantization
        pooler = None
        if self.model_config.runner_type == "pooling":
            classifier = activations = None
            if self.model_config.pooling_task == "classify":
                # HF's `score` layer: num_labels outputs, no bias; the loader fills it.
                with default_dtype(self.dtype), torch.device(self.platform.device):
                    classifier = torch.nn.Linear(hf_config.hidden_size, hf_config.num_labels, False)
                model.score = classifier
                activations = {
                    "classify": classify_activation(hf_config),
                    "score": score_activation(hf_config),
                }
            pooler = Pooler(self.model_config.pooler_config, classifier, activations)
            if getattr(model, "lm_head", None) is not None:
                model.lm_head = None  # never used; an untied one is vocabulary x hidden
        if self.model_config.load_format == "dummy":
            initialize_dummy_weights(model, self.model_config.seed)
        else:
            weights = iter_weights(
                self.model_config.model, self.dtype, quantization, self.platform.device
            )
            if pooler is not None:
                weights = as_pooling_model_names(model, weights)
            if stage:  # the tensors of this stage's layers alone
                weights = ((name, t) for name, t in weights if model.holds_weight(name))
            model.load_weights(weights)
        process_weights_after_loading(model)
        self.weight_memory_bytes = weight_bytes(model)
        logger.info(
            "Model weights: %.1f MiB (quantization=%s).",
            self.weight_memory_bytes / (1 << 20),
            quantization or "none",
        )
        self.model = model.eval()
        self.lora_manager = None
        if self.config.lora_config is not None:
            from minivllm.lora.model_manager import LoRAModelManager

            self.lora_manager = LoRAModelManager(
                model, self.config.lora_config, self.dtype, self.platform.device
            )
        runner_model = self.model
        if stage:
            runner_model = StageModel(
                self.model, self.pp, hf_config.hidden_size, self.dtype, self.platform.device
            )
        self.model_runner = ModelRunner(
            runner_model,
            block_size,
            self.model_config.vocab_size,
            self.tp,
            self.config.scheduler_config,
            attn_backend=self.attn_backend,
            enforce_eager=self.model_config.enforce_eager,
            device=self.platform.device,
            kv_sharing_fast_prefill=self.config.cache_config.kv_sharing_fast_prefill,
            pooler=pooler,
            lora_manager=self.lora_manager,
            speculative_config=self.config.speculative_config,
            pp=self.pp,
        )
        calibrate_key_factors(self)

    def _kv_cache_spec(self, attn, num_blocks: int) -> tuple[tuple[int, ...], torch.dtype]:
        """(shape, dtype) of a layer's cache: the backend's, for the --kv-cache-dtype."""
        block_size = self.config.cache_config.block_size
        return self.attn_backend.kv_cache_spec(
            num_blocks, block_size, attn.num_kv_heads, attn.head_dim, self.kv_cache_dtype
        )

    def kv_cache_bytes_per_block(self) -> int:
        """The real bytes of one block in every layer (a quantized cache's scales included)."""
        specs = [self._kv_cache_spec(a, 1) for a in self.model.attention_layers()]
        return sum(math.prod(shape) * dtype.itemsize for shape, dtype in specs)

    def state_layers(self) -> list:
        """The model's layers that keep a per-request state (hybrid models), or none."""
        return self.model.state_layers() if hasattr(self.model, "state_layers") else []

    def kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec(
            self.config.cache_config.block_size,
            self.kv_cache_bytes_per_block(),
            state_bytes_per_slot(self.state_layers()),
        )

    def get_num_state_slots(self) -> int:
        """The state cache's slots (set by determine_num_blocks; 0: no state layers)."""
        return self.num_state_slots

    def add_lora(self, lora_request) -> str | None:
        """Read and check an adapter for this rank; what is wrong with it, or None. (An
        error is returned, not raised: a raise here would end the worker.)"""
        if self.lora_manager is None:
            return "LoRA is not enabled (enable_lora)."
        try:
            self.lora_manager.add_adapter(lora_request)
        except (ValueError, OSError) as exc:
            return str(exc)
        return None

    def get_weight_memory_bytes(self) -> int:
        """The bytes this rank's weights hold, packed copies included (set at load)."""
        return self.weight_memory_bytes

    def determine_available_memory(self) -> int:
        """Bytes this worker may give the KV cache: kv_cache_memory_bytes when set (on the
        CPU, its default), else what gpu_memory_utilization of the card leaves after a
        profiling pass (``profile_run``). Every tensor-parallel rank measures its own."""
        spec = self.kv_cache_spec()
        min_bytes = self._blocks_for_max_model_len() * spec.bytes_per_block
        min_bytes += spec.bytes_per_state_slot
        return self.platform.available_kv_cache_memory(
            self.config.cache_config, self.profile_run, min_bytes
        )

    def _blocks_for_max_model_len(self) -> int:
        return -(-self.model_config.max_model_len // self.config.cache_config.block_size)

    def determine_num_blocks(self) -> int:
        cache = self.config.cache_config
        spec = self.kv_cache_spec()
        per_block = spec.bytes_per_block
        available = self.determine_available_memory()  # once: it may run a profiling pass
        # A hybrid model's state slots come out of the same budget (at most max_num_seqs).
        num_blocks, self.num_state_slots = spec.split_budget(
            available, self.config.scheduler_config.max_num_seqs, self.model_config.max_model_len
        )
        if spec.has_state and self.num_state_slots == 0:
            raise ValueError(
                f"The KV cache ({available / (1 << 30):.3f} GiB) holds no request's state "
                f"({spec.bytes_per_state_slot / (1 << 20):.1f} MiB) beside the blocks of "
                f"max_model_len={self.model_config.max_model_len} tokens. Raise "
                "kv_cache_memory_bytes (or MINIVLLM_CPU_KVCACHE_SPACE) or lower max_model_len."
            )
        needed = self._blocks_for_max_model_len()
        if num_blocks < needed:
            raise ValueError(
                f"max_model_len={self.model_config.max_model_len} needs "
                f"{needed * per_block / (1 << 30):.3f} GiB of KV cache ({needed} blocks of "
                f"{cache.block_size} tokens), but the KV cache has {available / (1 << 30):.3f} "
                f"GiB: it holds {num_blocks * cache.block_size} tokens, the longest "
                "max_model_len that fits. Raise kv_cache_memory_bytes (or "
                "MINIVLLM_CPU_KVCACHE_SPACE) or lower max_model_len."
            )
        return num_blocks

    @torch.inference_mode()
    def profile_run(self) -> int:
        """One dummy step at the scheduler's limits, for the memory it peaks at: a forward
        pass of max_num_batched_tokens tokens spread over up to max_num_seqs prompts, then
        the logits and a sampler pass over one row per prompt (the [rows, vocab] logits are
        large), while the forward's temporary KV cache is still held. Returns that cache's
        bytes."""
        sc = self.config.scheduler_config
        device = self.platform.device
        # A step holds at most max_num_seqs requests, each at most max_model_len long.
        num_tokens = min(sc.max_num_batched_tokens, sc.max_num_seqs * sc.max_model_len)
        num_reqs = min(sc.max_num_seqs, num_tokens)
        seq_lens = torch.full((num_reqs,), num_tokens // num_reqs, dtype=torch.int32)
        seq_lens[: num_tokens % num_reqs] += 1
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
        hidden, caches = dummy_forward(self, seq_lens, input_ids)
        last_tokens = seq_lens.cumsum(0).to(device) - 1
        # A pooling model has no head, and no sampler; a stage before the last neither.
        pooling = self.model_runner.pooler is not None or not self.pp.is_last
        logits = None if pooling else self.model.compute_logits(hidden[last_tokens])
        if logits is not None:  # None on tensor-parallel ranks other than 0
            self.model_runner.sampler(logits, _dummy_sampling_metadata(num_reqs, device))
        # The dummy draw used the global generator: reseed, so that sampling after start-up
        # does not depend on whether a profiling pass ran.
        torch.manual_seed(self.model_config.seed)
        return sum(c.numel() * c.element_size() for c in caches)

    def bind_kv_caches(self, num_blocks: int) -> list[torch.Tensor]:
        """A cache of num_blocks blocks for each attention layer, bound to it (the engine's,
        or dummy_forward.py's temporary one)."""
        caches = []
        # Zeroed: padded reads multiply stale slots by zero weight, never by NaN. In huge
        # pages on the host: a long context's decode reads each KV head's runs of a block,
        # blocks apart, a TLB walk each with 4 KiB pages (LFM2's 4k int8 attention call
        # 135 -> 127 us, Qwen3.5's 123 -> 118; Zen 5, alternated, same kernel).
        zeros = functools.partial(self.platform.zeros, huge_pages=True)
        for attn in self.model.attention_layers():
            attn.kv_cache = self.attn_backend.new_kv_cache(
                zeros,
                num_blocks,
                self.config.cache_config.block_size,
                attn.num_kv_heads,
                attn.head_dim,
                self.kv_cache_dtype,
            )
            caches.append(attn.kv_cache)
        return caches

    def initialize_kv_cache(self, num_blocks: int) -> None:
        block_size = self.config.cache_config.block_size
        self.kv_caches = self.bind_kv_caches(num_blocks)
        if getattr(self, "disk_io", None) is not None:  # woken from sleep: the same copier
            self.disk_io.kv_caches = self.kv_caches
        elif self.config.cache_config.kv_cache_disk:  # the persistent prefix cache's copies
            from minivllm.kv_offload.worker_io import BlockDiskIO

            self.disk_io = BlockDiskIO(self.config.cache_config, self.rank, self.kv_caches)
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB, kv_cache_dtype=%s)",
            num_blocks,
            block_size,
            num_blocks * self.kv_cache_bytes_per_block() / (1 << 30),
            self.config.cache_config.kv_cache_dtype,
        )
        state_layers = self.state_layers()
        if state_layers:
            sc = self.config.scheduler_config
            self.state_cache = StateCache(
                state_layers, self.num_state_slots, sc.max_num_seqs, self.platform.device
            )
            self.model_runner.set_state_cache(self.state_cache)
            spec = self.kv_cache_spec()
            logger.info(
                "State cache: %d slots (requests running at once) of %.2f MiB for %d state "
                "layers (%.2f GiB); the KV cache's %d blocks hold %d tokens for %d attention "
                "layers. A %d-token request holds %.1f MiB of cache.",
                self.num_state_slots,
                spec.bytes_per_state_slot / (1 << 20),
                len(state_layers),
                self.state_cache.nbytes / (1 << 30),
                num_blocks,
                num_blocks * block_size,
                len(self.model.attention_layers()),
                self.model_config.max_model_len,
                spec.request_bytes(self.model_config.max_model_len) / (1 << 20),
            )
        self.model_runner.capture_model()

    def sleep(self) -> int:
        """Doze (vLLM's sleep mode, level 1, for the KV cache alone): drop the KV cache and
        what points into it (captured graphs, the disk cache's copier's views); the weights
        stay.
        Returns the bytes let go. ``wake_up`` binds a new cache."""
        freed = sum(c.numel() * c.element_size() for c in self.kv_caches)
        for attn in self.model.attention_layers():
            attn.kv_cache = None
        self.kv_caches = []
        if getattr(self, "disk_io", None) is not None:
            self.disk_io.flush()  # queued blocks written; it copies from the new cache later
            self.disk_io.kv_caches = []
        runner = self.model_runner
        if runner.cpu_graphs is not None:
            runner.cpu_graphs = {}  # their calls hold the old cache's pointers
        runner.cuda_graphs = None  # captured again at wake_up
        gc.collect()
        self.platform.release_free_memory()
        return freed

    def wake_up(self, num_blocks: int) -> None:
        """Bind a new KV cache of num_blocks blocks after ``sleep``."""
        self.initialize_kv_cache(num_blocks)

    def execute_model(
        self, scheduler_output: SchedulerOutput
    ) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        """The step's output; with async scheduling, a handle whose get_output() waits."""
        self.platform.before_step()
        transfers = scheduler_output.kv_transfers
        if transfers is None:
            if self.pp.size == 1:
                return self.model_runner.execute_model(scheduler_output)
            start = time.perf_counter()
            output = self.model_runner.execute_model(scheduler_output)
            self.step_seconds += time.perf_counter() - start
            self.steps += 1
            return output
        self.disk_io.load(transfers)  # blocks read back from disk, before anything reads them
        output = self.model_runner.execute_model(scheduler_output)
        if transfers.saves:
            self.platform.synchronize()  # the step's K/V written before they are copied
            self.disk_io.save(transfers)
        return output

    def get_stage_times(self) -> tuple[float, float, int]:
        """A pipeline stage's (seconds in steps, seconds of them spent waiting for the
        stage before or on a send, steps run), since start-up: its idle time over a period
        is the period less the first plus the second."""
        model = self.model_runner.model
        return self.step_seconds, getattr(model, "wait_seconds", 0.0), self.steps

    def shutdown(self) -> None:
        if getattr(self, "disk_io", None) is not None:
            self.disk_io.flush()  # queued blocks reach the disk before the process ends
        if isinstance(self.model_runner.model if self.model_runner else None, StageModel):
            self.model_runner.model.wait_sent()
        if self.config.parallel_config.world_size > 1:
            destroy_parallel_groups()


def as_pooling_model_names(model: torch.nn.Module, weights):
    """The checkpoint's tensors named as the pooling model's (which has no LM head). An
    embedding model's checkpoint often holds the bare network (Qwen3Model: "layers.0...",
    no "model." prefix) and no head; a causal LM's head is skipped."""
    inner = getattr(model, "model", None)
    for name, tensor in weights:
        if name.startswith("lm_head."):
            continue
        if (
            inner is not None
            and not name.startswith("model.")
            and hasattr(inner, name.split(".", 1)[0])
        ):
            name = "model." + name
        yield name, tensor


def _dummy_sampling_metadata(num_rows: int, device: torch.device) -> SamplingMetadata:
    """Random sampling with top-p: the sampler's largest allocations (a sort of the logits)."""
    return SamplingMetadata(
        temperature=torch.full((num_rows,), 0.5, device=device),
        all_greedy=False,
        top_k=None,
        top_p=torch.full((num_rows,), 0.9, device=device),
        min_p=None,
        generators={},
    )
