"""AsyncLLM: vLLM's asyncio engine. Many concurrent generate() streams share one core.

The engine core always runs in its own process (AsyncMPClient). One asyncio task, the
output handler, takes each step's outputs from the client, detokenizes them and puts
each request's RequestOutput on that request's asyncio.Queue, which its generate() reads.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Iterable

from minivllm.config import VllmConfig
from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.core_client import AsyncMPClient, EngineCoreClient
from minivllm.engine.exceptions import EngineDeadError
from minivllm.engine.frontend import EngineFrontend, config_with_core
from minivllm.engine.messages import SchedulerStats
from minivllm.engine.processor import PromptType
from minivllm.lora.request import LoRARequest
from minivllm.outputs import PoolingRequestOutput, RequestOutput
from minivllm.pooling_params import PoolingParams
from minivllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Outputs are detokenized in chunks of this many requests, yielding to the event loop in
# between, so that a large batch does not stall the streams' consumers.
OUTPUT_CHUNK_SIZE = 128


class _HandlerState:
    """What the output handler shares with AsyncLLM (the task must not hold AsyncLLM)."""

    def __init__(self) -> None:
        self.last_stats: SchedulerStats | None = None
        self.error: BaseException | None = None


class AsyncLLM(EngineFrontend):
    def __init__(
        self,
        vllm_config: VllmConfig,
        tokenizer=None,
        log_requests: bool = False,
        engine_core: AsyncMPClient | None = None,
    ) -> None:
        """tokenizer None: load the model's (while the core loads the model); engine_core:
        a core process started before the config (``start_engine_core``)."""
        self.log_requests = log_requests
        if engine_core is None:  # (a DPClient with data_parallel_size > 1)
            engine_core = EngineCoreClient.make_client(vllm_config, True, asyncio_mode=True)
        else:
            engine_core.configure(vllm_config)
        self._start(vllm_config, engine_core, tokenizer)
        self._state = _HandlerState()
        self._output_handler: asyncio.Task | None = None

    @classmethod
    def from_engine_args(
        cls, engine_args: EngineArgs, engine_core: AsyncMPClient | None = None, **kwargs
    ) -> AsyncLLM:
        """From AsyncEngineArgs (or EngineArgs). vLLM's other keyword arguments are ignored.
        The core's process starts first (unless given), and imports while the config is
        built."""
        config, engine_core = config_with_core(engine_args, engine_core, asyncio_mode=True)
        return cls(
            config,
            log_requests=getattr(engine_args, "enable_log_requests", False),
            engine_core=engine_core,
        )

    @classmethod
    def from_vllm_config(cls, vllm_config: VllmConfig, **kwargs) -> AsyncLLM:
        return cls(vllm_config)

    # ------------------------------------------------------------------ requests

    async def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        prompt_text: str | None = None,
    ) -> asyncio.Queue:
        """Send a request to the core; returns the queue its outputs will arrive on. prompt:
        also an EngineCoreRequest from ``processor.process_inputs`` (with its prompt_text),
        as vLLM's server sends one it has checked already."""
        if self.errored:
            raise self.dead_error
        self._start_output_handler()
        queue: asyncio.Queue = asyncio.Queue()
        core_requests = self._core_requests(
            request_id, prompt, params, arrival_time, priority, lora_request, queue, prompt_text
        )
        with self._sending(request_id):
            for core_request in core_requests:
                await self.engine_core.add_request_async(core_request)
        if self.log_requests:
            logger.info("Added request %s.", request_id)
        return queue

    def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        prompt_text: str | None = None,
        **kwargs,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream a request's outputs, as its sampling_params.output_kind says.

        Cancelling the task that iterates, or closing the generator before the last
        output, aborts the request in the engine core. Raises EngineDeadError if the core
        dies. vLLM's other keyword arguments (trace_headers, ...) are ignored.
        """
        return self._outputs(
            prompt, sampling_params, request_id, priority, lora_request, prompt_text
        )

    def encode(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams,
        request_id: str,
        *,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        prompt_text: str | None = None,
        **kwargs,
    ) -> AsyncGenerator[PoolingRequestOutput, None]:
        """A pooling request (the pooling runner): yields its one output, the embedding.
        Cancelling or closing it early aborts the request, as generate()."""
        return self._outputs(
            prompt, pooling_params, request_id, priority, lora_request, prompt_text
        )

    async def _outputs(
        self,
        prompt,
        params: SamplingParams | PoolingParams,
        request_id: str,
        priority: int,
        lora_request: LoRARequest | None = None,
        prompt_text: str | None = None,
    ) -> AsyncGenerator:
        """Add the request, then yield its outputs from its queue until the finished one."""
        queue = await self.add_request(
            request_id,
            prompt,
            params,
            priority=priority,
            lora_request=lora_request,
            prompt_text=prompt_text,
        )
        finished = False
        try:
            while not finished:
                output = queue.get_nowait() if not queue.empty() else await queue.get()
                if isinstance(output, BaseException):
                    raise output
                finished = output.finished
                yield output
        except EngineDeadError:
            raise
        except BaseException:  # cancelled, closed early, or the consumer failed
            if not finished:
                self._abort(request_id)
            raise

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort requests; a stream still iterating gets a last output ("abort") and ends."""
        self._abort([request_id] if isinstance(request_id, str) else list(request_id))

    def _abort(self, request_ids: str | list[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        core_ids = self._abort_requests(request_ids)
        if self.log_requests and core_ids:
            logger.info("Aborted request(s) %s.", ", ".join(request_ids))

    # ------------------------------------------------------------------ the output handler

    def _start_output_handler(self) -> None:
        if self._output_handler is not None and not self._output_handler.done():
            return
        engine_core, output_processor, processor, state = (
            self.engine_core,
            self.output_processor,
            self.processor,
            self._state,
        )

        async def output_handler() -> None:
            try:
                while True:
                    outputs = await engine_core.get_output_async()
                    items = outputs.outputs
                    for start in range(0, len(items), OUTPUT_CHUNK_SIZE):
                        if start:
                            await asyncio.sleep(0)
                        chunk = items[start : start + OUTPUT_CHUNK_SIZE]
                        processed = output_processor.process_outputs(chunk, outputs.engine_index)
                        engine_core.abort_requests(processed.reqs_to_abort)
                    if outputs.scheduler_stats is not None:
                        state.last_stats = outputs.scheduler_stats
                        if processor.slo_admission is not None:
                            processor.slo_admission.update(
                                outputs.scheduler_stats.slo_step_time_model
                            )
            except asyncio.CancelledError:
                raise
            except BaseException as exc:
                if isinstance(exc, EngineDeadError):
                    error = exc
                else:
                    logger.exception("AsyncLLM's output handler failed")
                    error = EngineDeadError("AsyncLLM's output handler failed.")
                    error.__cause__ = exc
                state.error = error
                output_processor.propagate_error(error)

        self._output_handler = asyncio.get_running_loop().create_task(
            output_handler(), name="AsyncLLM output handler"
        )

    # ------------------------------------------------------------------ state and utilities

    @property
    def errored(self) -> bool:
        return self._state.error is not None or self.engine_core.is_dead()

    @property
    def dead_error(self) -> BaseException:
        if self._state.error is not None:
            return self._state.error
        if self.engine_core.is_dead():
            return self.engine_core.dead_error()
        return EngineDeadError()

    @property
    def is_running(self) -> bool:
        return not self.errored and not self.engine_core.is_closed()

    @property
    def is_stopped(self) -> bool:
        return self.errored or self.engine_core.is_closed()

    async def check_health(self) -> None:
        if self.errored:
            raise self.dead_error

    def dead_engines(self) -> list[int]:
        """The engine cores (data-parallel replicas) that died while others serve on."""
        return getattr(self.engine_core, "dead_engines", list)()

    async def get_engine_stats(self) -> list[SchedulerStats | None]:
        """Each engine core's scheduler statistics (one without data parallelism; None for
        a replica that died)."""
        per_engine = getattr(self.engine_core, "get_engine_stats_async", None)
        if per_engine is None:
            return [await self.get_stats()]
        return await per_engine()

    def add_stat_logger(self, stat_logger) -> None:
        """Record each request's statistics (tokens, TTFT, inter-token latency, its end) into
        stat_logger as its outputs arrive (the server exports them)."""
        sched = self.vllm_config.scheduler_config
        self.output_processor.record_stats(
            stat_logger, (sched.default_slo_tpot, sched.default_slo_ttft)
        )

    async def get_tokenizer(self):
        return self.tokenizer

    @property
    def last_stats(self) -> SchedulerStats | None:
        """The statistics that came with the core's latest step."""
        return self._state.last_stats

    async def get_stats(self) -> SchedulerStats:
        """The scheduler's statistics now, asked of the engine core."""
        return await self.engine_core.get_stats_async()

    async def reset_prefix_cache(self) -> bool:
        return await self.engine_core.reset_prefix_cache_async()

    async def sleep(self, level: int = 1) -> int:
        """vLLM's sleep mode, level 1 for the KV cache alone: the engine core drops its KV
        cache (the weights stay) until ``wake_up`` or its next request. Refused (a
        RuntimeError) while requests run. Returns the bytes let go."""
        return await self.engine_core.call_utility_async("sleep", level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Bind the engine core's KV cache again after ``sleep``."""
        await self.engine_core.call_utility_async("wake_up", tags)

    async def is_sleeping(self) -> bool:
        return await self.engine_core.call_utility_async("is_sleeping")

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and check an adapter in the engine core now (the server does so for each of
        --lora-modules at start-up). ValueError: the engine cannot serve it."""
        self.processor.validate_lora(lora_request)
        return await self.engine_core.add_lora_async(lora_request)

    async def start_profile(self) -> None:
        """Start a torch.profiler trace of the engine core (needs VLLM_TORCH_PROFILER_DIR)."""
        await self.engine_core.profile_async(True)

    async def stop_profile(self) -> None:
        """Stop the trace and write it into the profiler folder."""
        await self.engine_core.profile_async(False)

    def shutdown(self) -> None:
        """Stop the output handler and the engine core process."""
        handler = getattr(self, "_output_handler", None)
        self._output_handler = None
        if handler is not None and not handler.done():
            try:
                handler.cancel()
            except RuntimeError:  # its event loop is already closed
                pass
        self.engine_core.shutdown()

    def __del__(self) -> None:
        if getattr(self, "engine_core", None) is not None:
            self.shutdown()
