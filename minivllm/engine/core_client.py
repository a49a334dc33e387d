"""How the frontend reaches the engine core; the transport is chosen here, not in the core.

- InprocClient: the core in this process; get_output() runs one step (debugging, tests).
- SyncMPClient: the core in its own process (LLM, LLMEngine); get_output() waits for
  the next step's outputs, which the core computes while the frontend detokenizes.
- AsyncMPClient: the same process and sockets for asyncio (AsyncLLM).

The multiprocess clients bind two ZeroMQ sockets (ipc in a private temporary folder, or a
free TCP port on localhost when the path would be too long) and start the core with the
spawn method: PUSH requests -> the core's input thread; the core's output thread PUSHes
-> our PULL, read by one thread here. A second thread watches the process: if it ends
without being told to, every pending and later call raises EngineDeadError.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.util  # registers its exit hook before ours: ours then runs first
import os
import queue
import shutil
import signal
import sys
import tempfile
import threading
import time
import weakref
from typing import Any

import msgspec
import zmq

from minivllm.config import VllmConfig
from minivllm.engine.core_proc import EXIT_CODE_REPORTED, run_engine_core
from minivllm.engine.exceptions import EngineDeadError, rebuild_error
from minivllm.engine.messages import (
    EngineCoreError,
    EngineCoreOutputs,
    EngineCoreOutputType,
    EngineCoreReady,
    EngineCoreRequest,
    EngineCoreRequestType,
    SchedulerStats,
    UtilityRequest,
    UtilityResult,
)

logger = logging.getLogger(__name__)

# How long start-up may take: loading a large model from a slow disk takes minutes. A core
# that dies during start-up is noticed at once, whatever this says.
ENGINE_READY_TIMEOUT_S = 600.0
_SHUTDOWN_GRACE_S = 5.0
_POLL_MS = 200

# Result types of the EngineCore methods called through UTILITY messages.
_UTILITY_RESULT_TYPES: dict[str, Any] = {"get_stats": SchedulerStats, "reset_prefix_cache": bool}


class EngineCoreClient:
    """The interface every transport implements."""

    @staticmethod
    def make_client(
        vllm_config: VllmConfig, multiprocess_mode: bool, asyncio_mode: bool = False
    ) -> EngineCoreClient:
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
        self.num_blocks = self.engine_core.num_blocks

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

    def profile(self, is_start: bool = True) -> None:
        self.engine_core.profile(is_start)

    def shutdown(self) -> None:
        self.engine_core.shutdown()


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


class _CoreProcResources:
    """What a multiprocess client owns, apart from the client object.

    The finalizer and the exit hook hold this and not the client, so that dropping the
    last reference to the client (or to the LLM over it) shuts the core process down.
    """

    def __init__(self, sink: _QueueSink | _AsyncioSink) -> None:
        self.sink = sink
        self.ctx = zmq.Context()
        self.ipc_dir = tempfile.mkdtemp(prefix="minivllm-")
        self.input_socket = self.ctx.socket(zmq.PUSH)
        self.input_socket.setsockopt(zmq.SNDHWM, 0)
        self.input_address = _bind(self.input_socket, os.path.join(self.ipc_dir, "input"))
        self.output_socket = self.ctx.socket(zmq.PULL)
        self.output_socket.setsockopt(zmq.RCVHWM, 0)
        self.output_address = _bind(self.output_socket, os.path.join(self.ipc_dir, "output"))
        self.proc: multiprocessing.process.BaseProcess | None = None
        self.send_lock = threading.Lock()
        self.lock = threading.Lock()
        self.pending_calls: dict[int, tuple[concurrent.futures.Future, Any]] = {}
        self.dead_cause: BaseException | None = None
        self.closing = False
        self.closed = False
        self.threads: list[threading.Thread] = []

    def mark_dead(self, cause: BaseException) -> None:
        """The core is gone: fail every pending call, and wake whoever waits for outputs."""
        with self.lock:
            if self.dead_cause is not None or self.closing:
                return
            self.dead_cause = cause
            calls, self.pending_calls = self.pending_calls, {}
        logger.error("The engine core died: %s", cause, exc_info=cause)
        for future, _ in calls.values():
            if not future.done():
                future.set_exception(self.dead_error())
        self.sink.put(self.dead_error())

    def send_shutdown(self) -> None:
        """Tell the core to exit (best effort: it may be gone already)."""
        if self.send_lock.acquire(timeout=1.0):
            try:
                self.input_socket.send_multipart(
                    (EngineCoreRequestType.SHUTDOWN.value, b""), flags=zmq.NOBLOCK
                )
            except zmq.ZMQError:
                pass
            finally:
                self.send_lock.release()

    def dead_error(self) -> EngineDeadError:
        error = EngineDeadError()
        error.__cause__ = self.dead_cause
        return error

    def shutdown(self) -> None:
        """Stop the core process (ask, then SIGTERM, then SIGKILL) and free the sockets."""
        with self.lock:
            if self.closed:
                return
            self.closing = self.closed = True
            calls, self.pending_calls = self.pending_calls, {}
        proc = self.proc
        if proc is not None and proc.is_alive():
            self.send_shutdown()
            _stop_process(proc)
        current = threading.current_thread()
        for thread in self.threads:
            if thread is not current:
                thread.join(timeout=2 * _POLL_MS / 1000)
        for future, _ in calls.values():
            if not future.done():
                future.set_exception(EngineDeadError("The engine was shut down."))
        self.sink.put(EngineDeadError("The engine was shut down."))  # wake any waiter
        self.input_socket.close(linger=0)
        self.output_socket.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def _bind(sock: zmq.Socket, ipc_path: str) -> str:
    """Bind to an ipc path, or to a free localhost port when the path is too long."""
    if len(ipc_path) < 100:  # sockaddr_un holds 107 bytes
        address = f"ipc://{ipc_path}"
        sock.bind(address)
        return address
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    return f"tcp://127.0.0.1:{port}"


def _stop_process(proc) -> None:
    proc.join(_SHUTDOWN_GRACE_S)
    if proc.is_alive():
        logger.warning("The engine core did not exit when asked; sending SIGTERM")
        proc.terminate()
        proc.join(_SHUTDOWN_GRACE_S)
    if proc.is_alive():
        logger.warning("The engine core ignored SIGTERM; sending SIGKILL")
        proc.kill()
        proc.join()


@contextlib.contextmanager
def _main_module_hidden():
    """Start a spawned process without re-running the user's script in it.

    spawn runs the parent's ``__main__`` file again in the child (as ``__mp_main__``) so
    that objects defined there unpickle. The core needs nothing from it, and a script
    without an ``if __name__ == "__main__":`` guard would create a second engine in the
    child. spawn finds the script through ``__spec__`` and ``__file__``: hidden while the
    child's start-up data is written, then put back.
    """
    namespace = vars(sys.modules["__main__"])
    saved = {k: namespace[k] for k in ("__spec__", "__file__") if k in namespace}
    namespace["__spec__"] = None
    namespace.pop("__file__", None)
    try:
        yield
    finally:
        namespace.pop("__spec__", None)
        namespace.update(saved)


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return f"was killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


def _read_outputs(resources: _CoreProcResources) -> None:
    """Output thread: decode what the core sends; outputs to the sink, results to callers."""
    decode_outputs = msgspec.msgpack.Decoder(EngineCoreOutputs).decode
    decode_result = msgspec.msgpack.Decoder(UtilityResult).decode
    decode_error = msgspec.msgpack.Decoder(EngineCoreError).decode
    sock = resources.output_socket
    while not resources.closing and resources.dead_cause is None:
        try:
            if not sock.poll(_POLL_MS):
                continue
            type_frame, payload = sock.recv_multipart(copy=False)
            output_type = EngineCoreOutputType(type_frame.bytes)
            if output_type == EngineCoreOutputType.OUTPUTS:
                resources.sink.put(decode_outputs(payload.buffer))
            elif output_type == EngineCoreOutputType.UTILITY:
                result = decode_result(payload.buffer)
                with resources.lock:
                    future, kind = resources.pending_calls.pop(result.call_id, (None, None))
                if future is None or future.done():
                    continue  # unknown, or cancelled by a caller that stopped waiting
                if result.error is not None:
                    future.set_exception(RuntimeError(result.error))
                else:
                    future.set_result(msgspec.msgpack.decode(result.result, type=kind))
            elif output_type == EngineCoreOutputType.DEAD:
                resources.mark_dead(rebuild_error(decode_error(payload.buffer)))
                resources.send_shutdown()  # the report is read: the core may exit now
        except Exception as exc:  # a message we cannot read: nothing after it can be trusted
            if resources.closing:
                return
            resources.mark_dead(exc)


# How long to wait for the report of a core that exited saying it had sent one.
_REPORT_GRACE_S = 10.0


def _watch_process(resources: _CoreProcResources) -> None:
    """Monitor thread: a core process that ends unasked makes the engine dead."""
    proc = resources.proc
    multiprocessing.connection.wait([proc.sentinel])
    if resources.closing:
        return
    exitcode = proc.exitcode
    if exitcode is None:  # another thread reaped it first
        time.sleep(0.1)
        exitcode = proc.exitcode
    if exitcode == EXIT_CODE_REPORTED:
        # The core sent its own report; give the output thread time to read it (a loaded
        # machine can delay the message well past the process's exit).
        deadline = time.monotonic() + _REPORT_GRACE_S
        while resources.dead_cause is None and time.monotonic() < deadline:
            time.sleep(0.05)
    resources.mark_dead(
        RuntimeError(f"The engine core process (pid {proc.pid}) {_describe_exit(exitcode)}.")
    )


class MPClient(EngineCoreClient):
    """The core in a child process; the base of the sync and asyncio clients."""

    def __init__(self, vllm_config: VllmConfig, sink: _QueueSink | _AsyncioSink) -> None:
        self.resources = resources = _CoreProcResources(sink)
        self._encoder = msgspec.msgpack.Encoder()
        self._call_ids = itertools.count()
        self._ready = False
        self.num_blocks: int | None = None
        # Shut the core down when this client is collected, and at exit: ours runs before
        # multiprocessing's own exit hook, which would wait for the core forever.
        self._finalizer = weakref.finalize(self, resources.shutdown)
        atexit.register(resources.shutdown)
        try:
            context = multiprocessing.get_context("spawn")
            resources.proc = context.Process(
                target=run_engine_core,
                name="EngineCore",
                kwargs=dict(
                    vllm_config=vllm_config,
                    input_address=resources.input_address,
                    output_address=resources.output_address,
                    parent_pid=os.getpid(),
                    ipc_dir=resources.ipc_dir,
                ),
            )
            with _main_module_hidden():
                resources.proc.start()
        except BaseException:
            self.shutdown()
            raise

    def wait_for_ready(self) -> None:
        """The handshake: the core's READY, or its start-up error raised here as it was."""
        if self._ready:
            return
        resources = self.resources
        try:
            self.num_blocks = self._wait_for_handshake()
        except BaseException:
            self.shutdown()
            raise
        self._ready = True
        for target, name in (
            (_read_outputs, "EngineCoreOutputReader"),
            (_watch_process, "EngineCoreMonitor"),
        ):
            thread = threading.Thread(target=target, args=(resources,), name=name, daemon=True)
            thread.start()
            resources.threads.append(thread)

    def _wait_for_handshake(self) -> int:
        resources = self.resources
        sock, proc = resources.output_socket, resources.proc
        deadline = time.monotonic() + ENGINE_READY_TIMEOUT_S
        report_deadline = None
        while True:
            alive = proc.is_alive()
            if sock.poll(100):
                type_frame, payload = sock.recv_multipart()
                output_type = EngineCoreOutputType(type_frame)
                if output_type == EngineCoreOutputType.READY:
                    return msgspec.msgpack.decode(payload, type=EngineCoreReady).num_blocks
                if output_type == EngineCoreOutputType.DEAD:
                    report = msgspec.msgpack.decode(payload, type=EngineCoreError)
                    raise rebuild_error(report)
                raise RuntimeError(f"Unexpected {output_type.name} message before READY.")
            if not alive and proc.exitcode == EXIT_CODE_REPORTED:
                # It reported its start-up error before exiting: wait for that report.
                report_deadline = report_deadline or time.monotonic() + _REPORT_GRACE_S
                if time.monotonic() < report_deadline:
                    continue
            if not alive:
                raise RuntimeError(
                    f"The engine core process {_describe_exit(proc.exitcode)} during start-up; "
                    "see its log above."
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"The engine core was not ready after {ENGINE_READY_TIMEOUT_S:.0f} s."
                )

    # ------------------------------------------------------------------ sending

    def _check_alive(self) -> None:
        if self.resources.dead_cause is not None:
            raise self.resources.dead_error()
        if self.resources.closed:
            raise EngineDeadError("The engine was shut down.")

    def _send(self, request_type: EngineCoreRequestType, payload: Any) -> None:
        self._check_alive()
        resources = self.resources
        frames = (request_type.value, self._encoder.encode(payload))
        with resources.send_lock:
            while True:
                try:
                    resources.input_socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                    return
                except zmq.Again:  # no peer: the core is gone or not connected yet
                    if resources.dead_cause is not None:
                        raise resources.dead_error() from None
                    resources.input_socket.poll(100, zmq.POLLOUT)

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(EngineCoreRequestType.ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self.resources.dead_cause is None and not self.resources.closed:
            self._send(EngineCoreRequestType.ABORT, request_ids)

    def _start_call(self, method: str, *args) -> concurrent.futures.Future:
        resources = self.resources
        future: concurrent.futures.Future = concurrent.futures.Future()
        call_id = next(self._call_ids)
        with resources.lock:
            if resources.dead_cause is not None:
                raise resources.dead_error()
            resources.pending_calls[call_id] = (future, _UTILITY_RESULT_TYPES.get(method, Any))
        try:
            self._send(EngineCoreRequestType.UTILITY, UtilityRequest(call_id, method, list(args)))
        except BaseException:
            with resources.lock:
                resources.pending_calls.pop(call_id, None)
            raise
        return future

    def call_utility(self, method: str, *args) -> Any:
        """Run an EngineCore method in the core process and return its result."""
        return self._start_call(method, *args).result()

    def get_stats(self) -> SchedulerStats:
        return self.call_utility("get_stats")

    def reset_prefix_cache(self) -> bool:
        return self.call_utility("reset_prefix_cache")

    def profile(self, is_start: bool = True) -> None:
        self.call_utility("profile", is_start)

    @property
    def engine_pid(self) -> int | None:
        return self.resources.proc.pid if self.resources.proc is not None else None

    def is_dead(self) -> bool:
        return self.resources.dead_cause is not None

    def shutdown(self) -> None:
        self._finalizer()  # runs resources.shutdown once, and disarms the finalizer


class SyncMPClient(MPClient):
    """For LLM and LLMEngine: blocking calls."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        self._sink = _QueueSink()
        super().__init__(vllm_config, self._sink)

    def get_output(self) -> EngineCoreOutputs:
        self._check_alive()
        item = self._sink.queue.get()
        if isinstance(item, BaseException):
            raise item
        return item


class AsyncMPClient(MPClient):
    """For AsyncLLM: the waits are awaitables; sends never block (the socket has no limit)."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        self._sink = _AsyncioSink()
        super().__init__(vllm_config, self._sink)

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

    async def profile_async(self, is_start: bool = True) -> None:
        await self.call_utility_async("profile", is_start)
