"""LLMEngine: vLLM's synchronous engine API over an engine core client.

By default the engine core runs in its own process (SyncMPClient): while it computes a
step, this process detokenizes the previous one. ``enable_multiprocessing=False`` or
``MINIVLLM_ENABLE_MULTIPROCESSING=0`` keeps it in this process (InprocClient).
"""

from __future__ import annotations

import logging

from minivllm.config import VllmConfig
from minivllm.engine.arg_utils import EngineArgs, multiprocessing_default
from minivllm.engine.core_client import EngineCoreClient, MPClient
from minivllm.engine.frontend import EngineFrontend, config_with_core
from minivllm.engine.messages import SchedulerStats
from minivllm.engine.processor import PromptType
from minivllm.lora.request import LoRARequest
from minivllm.outputs import PoolingRequestOutput, RequestOutput
from minivllm.pooling_params import PoolingParams
from minivllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine(EngineFrontend):
    def __init__(
        self,
        vllm_config: VllmConfig,
        tokenizer=None,
        multiprocess_mode: bool | None = None,
        engine_core: MPClient | None = None,
    ) -> None:
        """tokenizer None: load the model's; multiprocess_mode None: from the environment;
        engine_core: a core process started before the config (``start_engine_core``)."""
        if multiprocess_mode is None:
            multiprocess_mode = multiprocessing_default()
        self.last_stats: SchedulerStats | None = None
        # A multiprocess core loads the model in its own process while the tokenizer loads.
        if engine_core is None:
            engine_core = EngineCoreClient.make_client(vllm_config, multiprocess_mode)
        else:
            engine_core.configure(vllm_config)
        self._start(vllm_config, engine_core, tokenizer)
        # What the model's weights take, as the start-up log says: "gguf" (blocks kept),
        # an online mode ("q8_0", ...: blocks made at load) or
        # "none", and the bytes of every rank's weights together.
        self.quantization: str = self.model_config.quantization or "none"
        self.weight_memory_bytes: int = self.engine_core.weight_memory_bytes

    @classmethod
    def from_engine_args(
        cls, engine_args: EngineArgs, engine_core: MPClient | None = None
    ) -> LLMEngine:
        """engine_core: the core process started for these arguments (by LLM, before its
        imports); else one is started here, and imports while the config is built."""
        config, engine_core = config_with_core(engine_args, engine_core, asyncio_mode=False)
        return cls(
            config, multiprocess_mode=engine_args.use_multiprocessing(), engine_core=engine_core
        )

    def get_tokenizer(self):
        return self.tokenizer

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        core_requests = self._core_requests(
            request_id, prompt, params, arrival_time, priority, lora_request
        )
        with self._sending(request_id):
            for core_request in core_requests:
                self.engine_core.add_request(core_request)

    def abort_request(self, request_ids: str | list[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        self._abort_requests(request_ids)

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        """The outputs of the core's next step; raises EngineDeadError if the core died.

        With nothing running it returns at once, after refreshing ``last_stats``.
        """
        if not self.output_processor.has_unfinished_requests():
            self.last_stats = self.engine_core.get_stats()
            return []
        outputs = self.engine_core.get_output()
        processed = self.output_processor.process_outputs(outputs.outputs)
        self.engine_core.abort_requests(processed.reqs_to_abort)
        if outputs.scheduler_stats is not None:
            self.last_stats = outputs.scheduler_stats
            if self.processor.slo_admission is not None:
                self.processor.slo_admission.update(outputs.scheduler_stats.slo_step_time_model)
        return processed.request_outputs

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    def get_stats(self) -> SchedulerStats:
        """The scheduler's statistics now, asked of the engine core."""
        return self.engine_core.get_stats()

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def sleep(self, level: int = 1) -> int:
        """vLLM's sleep mode, level 1 for the KV cache alone: the engine core drops its KV
        cache (the weights stay) until ``wake_up`` or its next request. Refused (a
        RuntimeError) while requests run. Returns the bytes let go."""
        freed = self._core_call("sleep", level)
        return sum(freed) if isinstance(freed, list) else freed  # (data parallel: each's)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bind the engine core's KV cache again after ``sleep``."""
        self._core_call("wake_up", tags)

    def is_sleeping(self) -> bool:
        sleeping = self._core_call("is_sleeping")
        return all(sleeping) if isinstance(sleeping, list) else sleeping

    def _core_call(self, method: str, *args):
        """An EngineCore method, in the core's process or in this one (no multiprocessing)."""
        core = self.engine_core
        if hasattr(core, "call_utility"):
            return core.call_utility(method, *args)
        return getattr(core.engine_core, method)(*args)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and check an adapter in the engine now, as vLLM's: a request naming it later
        finds it loaded. ValueError: the engine cannot serve it."""
        self.processor.validate_lora(lora_request)
        return self.engine_core.add_lora(lora_request)

    def start_profile(self) -> None:
        """Start a torch.profiler trace of the engine core (needs VLLM_TORCH_PROFILER_DIR)."""
        self.engine_core.profile(True)

    def stop_profile(self) -> None:
        """Stop the trace and write it into the profiler folder."""
        self.engine_core.profile(False)

    def shutdown(self) -> None:
        """Stop the engine core (and its process). Also done when the engine is collected."""
        self.engine_core.shutdown()

    def __del__(self) -> None:
        engine_core = getattr(self, "engine_core", None)
        if engine_core is not None:
            engine_core.shutdown()
