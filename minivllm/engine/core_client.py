"""How the frontend reaches the engine core; the transport is chosen here, not in the core.

- InprocClient: the core in this process; get_output() runs one step (debugging, tests).
- SyncMPClient: the core in its own process (LLM, LLMEngine); get_output() waits for
  the next step's outputs, which the core computes while the frontend detokenizes.
- AsyncMPClient: the same process and sockets for asyncio (AsyncLLM).

The multiprocess clients encode and send; the core's process, its sockets and the threads
that read and watch them belong to an EngineCoreSupervisor (core_supervisor.py).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import itertools
import logging
import multiprocessing.util  # noqa: F401  registers its exit hook before ours: ours runs first
import queue
import threading
import weakref
from typing import Any

import msgspec

from minivllm.config import VllmConfig
from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.core_supervisor import EngineCoreSupervisor
from minivllm.engine.exceptions import EngineDeadError
from minivllm.engine.messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    SchedulerStats,
    UtilityRequest,
)

logger = logging.getLogger(__name__)

# Result types of the EngineCore methods called through UTILITY messages.
_UTILITY_RESULT_TYPES: dict[str, Any] = {
    "get_stats": SchedulerStats,
    "reset_prefix_cache": bool,
    "add_lora": bool,
}


def start_engine_core(engine_args: EngineArgs, asyncio_mode: bool = False) -> MPClient | None:
    """The engine core's process, started from the engine arguments alone, before the
    frontend imports torch and transformers and builds the VllmConfig: the core imports its
    share meanwhile (seconds of start-up that overlap). None where the core will run in
    this process. The caller hands the client to LLMEngine or AsyncLLM, which configure it;
    on any failure before that, it must ``shutdown()`` it. With data_parallel_size > 1,
    one process per engine core (a DPClient)."""
    if not (asyncio_mode or engine_args.use_multiprocessing()):
        return None
    world_size = engine_args.tensor_parallel_size * engine_args.pipeline_parallel_size
    if engine_args.data_parallel_size > 1:
        from minivllm.engine.dp_client import DPClient

        return DPClient(
            None,
            world_size,
            engine_args.data_parallel_size,
            asyncio_mode,
            on_ray=engine_args.distributed_executor_backend == "ray",
            device=engine_args.device,
        )
    client = AsyncMPClient if asyncio_mode else SyncMPClient
    return client(None, world_size=world_size)


class EngineCoreClient:
    """The interface every transport implements."""

    num_blocks: int | None = None  # KV cache blocks, once the core is ready
    weight_memory_bytes: int | None = None  # the model's weights, all ranks, once ready
    step_time_model: list[float] | None = None  # the slo policy's, once ready

    @staticmethod
    def make_client(
        vllm_config: VllmConfig, multiprocess_mode: bool, asyncio_mode: bool = False
    ) -> EngineCoreClient:
        parallel = vllm_config.parallel_config
        if parallel.data_parallel_size > 1:
            from minivllm.engine.dp_client import DPClient

            return DPClient(
                vllm_config,
                parallel.world_size,
                parallel.data_parallel_size,
                asyncio_mode,
                on_ray=parallel.distributed_executor_backend == "ray",
                device=vllm_config.device,
            )
        if asyncio_mode:
            return AsyncMPClient(vllm_config)
        if multiprocess_mode:
            return SyncMPClient(vllm_config)
        return InprocClient(vllm_config)

    def wait_for_ready(self) -> None:
        """Block until the core is built; raises its start-up error."""

    def add_request(self, request: EngineCoreRequest) -> None:
        raise NotImplementedError

    def abort_requests(self, request_ids: list[str]) -> None:
        raise NotImplementedError

    def get_output(self) -> EngineCoreOutputs:
        raise NotImplementedError

    def get_stats(self) -> SchedulerStats:
        """The scheduler's statistics now (KV cache use, queue lengths, counters)."""
        raise NotImplementedError

    def reset_prefix_cache(self) -> bool:
        raise NotImplementedError

    def add_lora(self, lora_request) -> bool:
        """Have the engine read and check an adapter now (ValueError: it cannot serve it)."""
        raise NotImplementedError

    def profile(self, is_start: bool = True) -> None:
        """Start or stop the core process's torch.profiler trace."""
        raise NotImplementedError

    def shutdown(self) -> None:
        pass


class InprocClient(EngineCoreClient):
    """The core in this process: get_output() runs one step."""

    def __init__(self, config: VllmConfig) -> None:
        from minivllm.engine.core import EngineCore  # the model code, only when needed

        self.engine_core = EngineCore(config)
        # Shut down once: by shutdown(), when collected, or at interpreter exit while the
        # modules its threads and executor need are still there (an engine left open at
        # exit otherwise stopped during module teardown: an ignored AttributeError, and
        # with Ray actors a segfault).
        self._shutdown = weakref.finalize(self, EngineCore.shutdown, self.engine_core)
        self.num_blocks = self.engine_core.num_blocks
        self.weight_memory_bytes = self.engine_core.weight_memory_bytes
        self.step_time_model = self.engine_core.step_time_model()

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.engine_core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        return self.engine_core.step()

    def get_stats(self) -> SchedulerStats:
        return self.engine_core.get_stats()

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def add_lora(self, lora_request) -> bool:
        return self.engine_core.add_lora(lora_request)

    def profile(self, is_start: bool = True) -> None:
        self.engine_core.profile(is_start)

    def shutdown(self) -> None:
        self._shutdown()


# --------------------------------------------------------------------- multiprocess


class _QueueSink:
    """Where the output thread puts outputs for a synchronous caller."""

    def __init__(self) -> None:
        self.queue: queue.Queue = queue.Queue()

    def put(self, item: EngineCoreOutputs | BaseException) -> None:
        self.queue.put(item)


class _AsyncioSink:
    """Hands outputs to an asyncio queue in the loop that first asks for them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: asyncio.Queue | None = None
        self._early: list = []  # items that came before a loop asked

    def put(self, item: EngineCoreOutputs | BaseException) -> None:
        with self._lock:
            if self._loop is None:
                self._early.append(item)
                return
            loop, q = self._loop, self._queue
        try:
            loop.call_soon_threadsafe(q.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is waiting
            pass

    def get_queue(self) -> asyncio.Queue:
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._loop is not loop:
                if self._loop is not None and not self._loop.is_closed():
                    raise RuntimeError("AsyncLLM is already in use by another event loop.")
                self._loop, self._queue = loop, asyncio.Queue()
                for item in self._early:
                    self._queue.put_nowait(item)
                self._early.clear()
            return self._queue


class MPClient(EngineCoreClient):
    """The core in a child process; the base of the sync and asyncio clients."""

    def __init__(
        self,
        vllm_config: VllmConfig | None,
        sink: _QueueSink | _AsyncioSink,
        world_size: int = 1,
        supervisor: EngineCoreSupervisor | None = None,
    ) -> None:
        """vllm_config None: the core's process starts now, and imports the engine while
        the caller builds the config; ``configure`` sends it (see ``start_engine_core``).
        supervisor: one of another kind (a Ray actor's, dp_ray.py), made for ``sink``."""
        self.supervisor = supervisor = supervisor or EngineCoreSupervisor(
            sink, vllm_config.parallel_config.world_size if vllm_config else world_size
        )
        self._encoder = msgspec.msgpack.Encoder()
        self._call_ids = itertools.count()
        self._ready = False
        self.num_blocks: int | None = None
        self.weight_memory_bytes: int | None = None
        # Shut the core down when this client is collected, and at exit: ours runs before
        # multiprocessing's own exit hook, which would wait for the core forever.
        self._finalizer = weakref.finalize(self, supervisor.shutdown)
        atexit.register(supervisor.shutdown)
        try:
            supervisor.start()
            if vllm_config is not None:
                supervisor.configure(vllm_config)
        except BaseException:
            self.shutdown()
            raise

    def configure(self, vllm_config: VllmConfig) -> None:
        """Send the core its config (a client started without one)."""
        try:
            self.supervisor.configure(vllm_config)
        except BaseException:
            self.shutdown()
            raise

    def wait_for_ready(self) -> None:
        """The handshake: the core's READY, or its start-up error raised here as it was."""
        if self._ready:
            return
        if not self.supervisor.configured:
            raise RuntimeError("configure() the engine core before waiting for it")
        try:
            self.num_blocks = self.supervisor.wait_for_ready()
            self.weight_memory_bytes = self.supervisor.ready.weight_memory_bytes
            self.step_time_model = self.supervisor.ready.step_time_model
        except BaseException:
            self.shutdown()
            raise
        self._ready = True

    # ------------------------------------------------------------------ sending

    def _check_alive(self) -> None:
        if self.supervisor.dead_cause is not None:
            raise self.supervisor.dead_error()
        if self.supervisor.closed:
            raise EngineDeadError("The engine was shut down.")

    def _send(self, request_type: EngineCoreRequestType, payload: Any) -> None:
        self._check_alive()
        self.supervisor.send((request_type.value, self._encoder.encode(payload)))

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(EngineCoreRequestType.ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self.supervisor.dead_cause is None and not self.supervisor.closed:
            self._send(EngineCoreRequestType.ABORT, request_ids)

    def _start_call(self, method: str, *args) -> concurrent.futures.Future:
        call_id = next(self._call_ids)
        future = self.supervisor.expect_result(call_id, _UTILITY_RESULT_TYPES.get(method, Any))
        try:
            self._send(EngineCoreRequestType.UTILITY, UtilityRequest(call_id, method, list(args)))
        except BaseException:
            self.supervisor.forget_result(call_id)
            raise
        return future

    def call_utility(self, method: str, *args) -> Any:
        """Run an EngineCore method in the core process and return its result."""
        return self._start_call(method, *args).result()

    def get_stats(self) -> SchedulerStats:
        return self.call_utility("get_stats")

    def reset_prefix_cache(self) -> bool:
        return self.call_utility("reset_prefix_cache")

    def add_lora(self, lora_request) -> bool:
        return _utility_value_error(lambda: self.call_utility("add_lora", lora_request))

    def profile(self, is_start: bool = True) -> None:
        self.call_utility("profile", is_start)

    @property
    def engine_pid(self) -> int | None:
        return self.supervisor.engine_pid

    def is_dead(self) -> bool:
        return self.supervisor.dead_cause is not None

    def is_closed(self) -> bool:
        return self.supervisor.closed

    def dead_error(self) -> EngineDeadError:
        """The error every call raises once the core has died (its cause attached)."""
        return self.supervisor.dead_error()

    def shutdown(self) -> None:
        self._finalizer()  # runs supervisor.shutdown once, and disarms the finalizer
        # The exit hook goes too: a server that starts and stops many engine cores (one per
        # model loaded) would otherwise keep every stopped core's supervisor until exit.
        atexit.unregister(self.supervisor.shutdown)


class SyncMPClient(MPClient):
    """For LLM and LLMEngine: blocking calls."""

    def __init__(self, vllm_config: VllmConfig | None, world_size: int = 1) -> None:
        self._sink = _QueueSink()
        super().__init__(vllm_config, self._sink, world_size)

    def get_output(self) -> EngineCoreOutputs:
        self._check_alive()
        item = self._sink.queue.get()
        if isinstance(item, BaseException):
            raise item
        return item


class AsyncMPClient(MPClient):
    """For AsyncLLM: the waits are awaitables; sends never block (the socket has no limit)."""

    def __init__(self, vllm_config: VllmConfig | None, world_size: int = 1) -> None:
        self._sink = _AsyncioSink()
        super().__init__(vllm_config, self._sink, world_size)

    async def get_output_async(self) -> EngineCoreOutputs:
        q = self._sink.get_queue()
        self._check_alive()
        item = await q.get()
        if isinstance(item, BaseException):
            raise item
        return item

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self.add_request(request)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        self.abort_requests(request_ids)

    async def call_utility_async(self, method: str, *args) -> Any:
        return await asyncio.wrap_future(self._start_call(method, *args))

    async def get_stats_async(self) -> SchedulerStats:
        return await self.call_utility_async("get_stats")

    async def reset_prefix_cache_async(self) -> bool:
        return await self.call_utility_async("reset_prefix_cache")

    async def add_lora_async(self, lora_request) -> bool:
        try:
            return await self.call_utility_async("add_lora", lora_request)
        except RuntimeError as exc:
            raise _as_value_error(exc) from None

    async def profile_async(self, is_start: bool = True) -> None:
        await self.call_utility_async("profile", is_start)


def _as_value_error(exc: RuntimeError) -> Exception:
    """A utility call's ValueError in the core (sent as "ValueError: text") as one here."""
    text = str(exc)
    return ValueError(text.removeprefix("ValueError: ")) if text.startswith("ValueError: ") else exc


def _utility_value_error(call):
    try:
        return call()
    except RuntimeError as exc:
        raise _as_value_error(exc) from None
