"""The engine core: scheduler + executor, stepping. It knows no sockets or tokenizers."""

from __future__ import annotations

import logging
import time

from minivllm.config import VllmConfig
from minivllm.core.request import Request, RequestStatus
from minivllm.core.sched_output import AsyncModelRunnerOutput, ModelRunnerOutput, SchedulerOutput
from minivllm.core.scheduler import Scheduler
from minivllm.core.scheduler_state import slo_coefficients
from minivllm.engine.batch_queue import BatchQueue
from minivllm.engine.messages import EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from minivllm.engine.profiler import TorchProfiler, profile_range, profiling_off_error
from minivllm.executor.abstract import Executor
from minivllm.lora.request import LoRARequest
from minivllm.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: VllmConfig) -> None:
        start = time.monotonic()
        self.config = config
        self.executor = Executor.get_class(config)(config)
        try:
            num_blocks = self.executor.determine_num_blocks()
            num_state_slots = self.executor.get_num_state_slots()
            self.executor.initialize_kv_cache(num_blocks)
        except BaseException:
            self.executor.shutdown()  # no worker process outlives a failed start
            raise
        self.num_blocks = num_blocks
        self.sleeping = False  # KV cache dropped (sleep); a request wakes it
        self.weight_memory_bytes = sum(self.executor.collective_rpc("get_weight_memory_bytes"))
        self.structured_output_manager = StructuredOutputManager(
            config.model_config, config.structured_outputs_config
        )
        self.scheduler = Scheduler(
            config.scheduler_config,
            config.cache_config,
            num_blocks,
            structured_output_manager=self.structured_output_manager,
            max_loras=config.lora_config.max_loras if config.lora_config else None,
            num_state_slots=num_state_slots,
        )
        self.profiler = TorchProfiler.from_env()  # None unless a trace folder is set
        self.known_loras: set[int] = set()  # adapter ids every worker has checked
        # Async scheduling: the step launched and not yet collected, with its schedule.
        self.async_scheduling = config.scheduler_config.async_scheduling
        self.in_flight: tuple[SchedulerOutput, AsyncModelRunnerOutput] | None = None
        # Pipeline parallelism: a step in flight per stage (seed 001's batch queue, deeper by
        # MINIVLLM_PP_EXTRA_BATCHES; of size 1 when MINIVLLM_PP_BATCH_QUEUE is off, still to
        # carry the sampled tokens).
        self.batch_queue: BatchQueue | None = None
        if config.parallel_config.pipeline_parallel_size > 1:
            size = self.executor.max_concurrent_batches
            logger.info("Batch queue is enabled with size %d", size)
            self.batch_queue = BatchQueue(self.scheduler, self.executor, size)
        # When the last step's outputs were collected (async scheduling: a step's time is
        # from its launch, or the previous collection if later, to its collection).
        self._collected_at = 0.0
        self._launched_at: float | None = None
        if config.scheduler_config.policy == "slo":
            from minivllm.engine.slo_calibration import calibrate

            calibrate(self)
        logger.info("Engine core ready in %.1f s", time.monotonic() - start)

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request; one the core cannot take fails alone (finish_reason "error")."""
        if self.sleeping:
            self.wake_up()
        try:
            if request.lora_request is not None:
                self.add_lora(request.lora_request)
            self.scheduler.add_request(Request.from_engine_core_request(request))
        except Exception:
            logger.exception("Request %s could not be added; it alone ends", request.request_id)
            self.scheduler.reject_request(request.request_id)

    def add_lora(self, lora_request: LoRARequest | list) -> bool:
        """Every worker reads and checks the adapter (once: it stays on their hosts); a
        ValueError says why one cannot serve it. (A list: the request as msgpack carried
        it, in a utility call.)"""
        if not isinstance(lora_request, LoRARequest):
            lora_request = LoRARequest(*lora_request)
        if self.config.lora_config is None:
            raise ValueError(f"Got lora_request {lora_request} but LoRA is not enabled!")
        if lora_request.lora_int_id in self.known_loras:
            return True  # checked once (a worker reads it again if it left its cache)
        errors = [e for e in self.executor.collective_rpc("add_lora", (lora_request,)) if e]
        if errors:
            raise ValueError(errors[0])
        self.known_loras.add(lora_request.lora_int_id)
        return True

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def step(self) -> EngineCoreOutputs:
        if self.batch_queue is not None:
            return self.batch_queue.step()
        if self.async_scheduling:
            return self._step_async()
        if not self.scheduler.has_unfinished_requests():
            return EngineCoreOutputs(scheduler_stats=self.scheduler.make_stats())
        start = time.perf_counter()
        scheduler_output, runner_output = self._launch()
        with profile_range("output_processing"):
            outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        self._observe(scheduler_output, time.perf_counter() - start)
        return outputs

    def _step_async(self) -> EngineCoreOutputs:
        """Launch the next step before collecting the one in flight: its schedule plans on
        the tokens in flight (placeholders) and its inputs take them on the device, so the
        device never waits for this process between steps. Returns the oldest step's
        outputs; a step is collected before the next is scheduled while some request needs
        its own outputs on the host."""
        scheduler = self.scheduler
        if self.in_flight is None:
            if not scheduler.has_unfinished_requests():
                return EngineCoreOutputs(scheduler_stats=scheduler.make_stats())
            self.in_flight = self._launch()
            self._launched_at = time.perf_counter()
        launched_at = self._launched_at
        following = None
        if scheduler.has_unfinished_requests() and not scheduler.needs_previous_outputs():
            following = self._launch()
            self._launched_at = time.perf_counter()
        scheduler_output, runner_output = self.in_flight
        self.in_flight = following
        with profile_range("output_processing"):
            outputs = scheduler.update_from_output(scheduler_output, runner_output.get_output())
        now = time.perf_counter()
        self._observe(scheduler_output, now - max(launched_at, self._collected_at))
        self._collected_at = now
        return outputs

    def _observe(self, scheduler_output: SchedulerOutput, seconds: float) -> None:
        if scheduler_output.total_num_scheduled_tokens:
            self.scheduler.policy.observe_step(scheduler_output, seconds)

    def _launch(self) -> tuple[SchedulerOutput, ModelRunnerOutput | AsyncModelRunnerOutput]:
        """Schedule a step and run it (under async scheduling: launch it)."""
        with profile_range("schedule"):
            scheduler_output = self.scheduler.schedule()
        with profile_range("execute_model"):
            return scheduler_output, self.executor.execute_model(scheduler_output)

    def has_unfinished_requests(self) -> bool:
        return (
            self.scheduler.has_unfinished_requests()
            or self.in_flight is not None
            or bool(self.batch_queue)
        )

    def step_time_model(self) -> list[float]:
        """The slo policy's step-time coefficients (empty under other policies)."""
        return slo_coefficients(self.scheduler)

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def sleep(self, level: int = 1) -> int:
        """vLLM's sleep mode at level 1, for the KV cache alone (a many-model server's doze):
        the workers drop their KV cache and the weights stay; the busy loop then waits on
        its input. Refused while requests run. Returns the bytes let go."""
        if self.has_unfinished_requests():
            raise ValueError("cannot sleep while requests run")
        if self.sleeping:
            return 0
        self.scheduler.kv_cache_manager.reset_prefix_cache()  # the blocks' K/V are dropped
        freed = sum(self.executor.collective_rpc("sleep"))
        self.sleeping = True
        return freed

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Bind a new KV cache after ``sleep`` (vLLM's name; tags are ignored)."""
        if self.sleeping:
            self.executor.collective_rpc("wake_up", (self.num_blocks,))
            self.sleeping = False
        return True

    def is_sleeping(self) -> bool:
        return self.sleeping

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.kv_cache_manager.reset_prefix_cache()

    def profile(self, is_start: bool = True) -> None:
        """Start or stop a torch.profiler trace of this process (vLLM's profile utility)."""
        if self.profiler is None:
            raise profiling_off_error()
        if is_start:
            self.profiler.start()
        else:
            self.profiler.stop()

    def shutdown(self) -> None:
        model = getattr(self.scheduler.policy, "model", None)
        if model is not None:
            model.log_error()  # the slo policy's step-time model, over its last steps
        self.structured_output_manager.shutdown()
        self.executor.shutdown()
