"""The engine core's process seen from the frontend: started, watched, stopped.

``EngineCoreSupervisor`` binds two ZeroMQ sockets (ipc in a private temporary folder, or a
free TCP port on localhost when the path would be too long) and spawns the core
(``core_proc.run_engine_core``) connected to them: requests go out on a PUSH socket to
the core's input thread; the core's output thread PUSHes to our PULL socket. After the
handshake one thread here reads that socket (outputs to the sink, utility results to
their callers), and a second waits on the process: if it ends without being told to,
every pending and later call raises EngineDeadError. Shutdown asks, then SIGTERM, then
SIGKILL. The clients (core_client.py) encode and send; this module owns the process.
"""

from __future__ import annotations

import concurrent.futures
import logging
import multiprocessing.connection
import os
import shutil
import tempfile
import threading
import time
from typing import Any, Protocol

import msgspec
import zmq

from minivllm import envs
from minivllm.config import VllmConfig
from minivllm.engine.core_proc import EXIT_CODE_REPORTED, run_engine_core
from minivllm.engine.exceptions import EngineDeadError, rebuild_error
from minivllm.engine.messages import (
    EngineCoreError,
    EngineCoreOutputs,
    EngineCoreOutputType,
    EngineCoreReady,
    EngineCoreRequestType,
    UtilityResult,
)
from minivllm.utils.process import (
    cpu_threads_plan,
    describe_exit,
    omp_thread_pinning_env,
    spawn_process,
)
from minivllm.utils.zmq_sockets import bind_socket

logger = logging.getLogger(__name__)

# How long start-up may take: loading a large model from a slow disk takes minutes. A core
# that dies during start-up is noticed at once, whatever this says.
ENGINE_READY_TIMEOUT_S = 600.0
_SHUTDOWN_GRACE_S = 5.0
_POLL_MS = 200
# How long to wait for the report of a core that exited saying it had sent one.
_REPORT_GRACE_S = 10.0


class OutputSink(Protocol):
    """Where the output thread puts the core's outputs (and the error that ends them)."""

    def put(self, item: EngineCoreOutputs | BaseException) -> None: ...


class EngineCoreSupervisor:
    """The core's process, its two sockets, and the threads that read and watch them.

    The clients' finalizer and exit hook hold this and not the client, so that dropping
    the last reference to the client (or to the LLM over it) shuts the core process down.
    """

    def __init__(self, sink: OutputSink, world_size: int = 1, host: str | None = None) -> None:
        """world_size: the tensor-parallel ranks the config will ask for (which decides how
        the core's process places its threads, before the config is sent). host: bind TCP
        ports on this address (a core on another machine connects to it), not ipc."""
        self.sink = sink
        self.ctx = zmq.Context()
        self.ipc_dir = tempfile.mkdtemp(prefix="minivllm-")
        self.input_socket = self.ctx.socket(zmq.PUSH)
        self.input_socket.setsockopt(zmq.SNDHWM, 0)
        self.input_address = self._bind(self.input_socket, "input", host)
        self.output_socket = self.ctx.socket(zmq.PULL)
        self.output_socket.setsockopt(zmq.RCVHWM, 0)
        self.output_address = self._bind(self.output_socket, "output", host)
        self.proc: multiprocessing.process.BaseProcess | None = None
        self.send_lock = threading.Lock()
        self.lock = threading.Lock()
        self.pending_calls: dict[int, tuple[concurrent.futures.Future, Any]] = {}
        self.dead_cause: BaseException | None = None
        self.ready: EngineCoreReady | None = None  # the core's handshake, once received
        self.closing = False
        self.closed = False
        self.threads: list[threading.Thread] = []
        self._world_size = world_size
        self._config_sink: multiprocessing.connection.Connection | None = None
        self.configured = False

    def _bind(self, sock: zmq.Socket, name: str, host: str | None) -> str:
        if host is None:
            return bind_socket(sock, os.path.join(self.ipc_dir, name))
        return bind_socket(sock, None, host)

    @property
    def engine_pid(self) -> int | None:
        """The core's process id (on its own machine)."""
        return self.proc.pid if self.proc is not None else None

    def start(self) -> None:
        """Spawn the core process, connected to our sockets; it imports the engine and
        waits for ``configure``."""
        config_source, self._config_sink = multiprocessing.Pipe(duplex=False)
        try:
            self.proc = spawn_process(
                run_engine_core,
                name="EngineCore",
                kwargs=dict(
                    config_source=config_source,
                    input_address=self.input_address,
                    output_address=self.output_address,
                    parent_pid=os.getpid(),
                    ipc_dir=self.ipc_dir,
                ),
                env=self._omp_env(),
            )
        finally:
            config_source.close()  # the child's end: if we die, its read ends

    def configure(self, vllm_config: VllmConfig) -> None:
        """Send the core its config (a few kB: the pipe takes it without waiting for the
        core, which may still be importing); it builds the engine, then says READY."""
        if vllm_config.parallel_config.world_size != self._world_size:
            raise ValueError(
                f"the core was started for {self._world_size} rank(s), the config has "
                f"{vllm_config.parallel_config.world_size}"
            )
        self._config_sink.send(vllm_config)
        self._config_sink.close()
        self.configured = True

    def _omp_env(self) -> dict[str, str]:
        """With a core list in MINIVLLM_CPU_OMP_THREADS_BIND and the model in the core's
        process (one rank), each of the core's OpenMP threads is pinned to one of them."""
        if self._world_size != 1:
            return {}
        try:
            cpus, _ = cpu_threads_plan(envs.MINIVLLM_CPU_OMP_THREADS_BIND, 0, 1)
        except ValueError:
            return {}  # the core fails on it and reports it
        return omp_thread_pinning_env(cpus)

    # ------------------------------------------------------------------ start-up

    def wait_for_ready(self) -> int:
        """The handshake: the core's READY (its number of KV cache blocks is returned), or
        its start-up error raised here as it was. Then the reader and monitor start."""
        num_blocks = self._wait_for_handshake()
        for target, name in (
            (self._read_outputs, "EngineCoreOutputReader"),
            (self._watch_engine, "EngineCoreMonitor"),
        ):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self.threads.append(thread)
        return num_blocks

    def _wait_for_handshake(self) -> int:
        sock = self.output_socket
        deadline = time.monotonic() + ENGINE_READY_TIMEOUT_S
        report_deadline = None
        while True:
            exitcode = self._engine_exitcode()
            alive = exitcode is None
            if sock.poll(100):
                type_frame, payload = sock.recv_multipart()
                output_type = EngineCoreOutputType(type_frame)
                if output_type == EngineCoreOutputType.READY:
                    self.ready = msgspec.msgpack.decode(payload, type=EngineCoreReady)
                    return self.ready.num_blocks
                if output_type == EngineCoreOutputType.DEAD:
                    report = msgspec.msgpack.decode(payload, type=EngineCoreError)
                    raise rebuild_error(report)
                raise RuntimeError(f"Unexpected {output_type.name} message before READY.")
            if exitcode == EXIT_CODE_REPORTED:
                # It reported its start-up error before exiting: wait for that report.
                report_deadline = report_deadline or time.monotonic() + _REPORT_GRACE_S
                if time.monotonic() < report_deadline:
                    continue
            if not alive:
                raise RuntimeError(
                    f"The engine core {self._describe_end(exitcode)} during start-up; "
                    "see its log above."
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"The engine core was not ready after {ENGINE_READY_TIMEOUT_S:.0f} s."
                )

    # ------------------------------------------------------------------ sending

    def send(self, frames: tuple) -> None:
        """Send one message to the core; waits while it is not connected yet."""
        with self.send_lock:
            while True:
                try:
                    self.input_socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                    return
                except zmq.Again:  # no peer: the core is gone or not connected yet
                    if self.dead_cause is not None:
                        raise self.dead_error() from None
                    self.input_socket.poll(100, zmq.POLLOUT)

    def expect_result(self, call_id: int, result_type: Any) -> concurrent.futures.Future:
        """A future for the result of utility call ``call_id`` (decoded as result_type)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self.lock:
            if self.dead_cause is not None:
                raise self.dead_error()
            self.pending_calls[call_id] = (future, result_type)
        return future

    def forget_result(self, call_id: int) -> None:
        with self.lock:
            self.pending_calls.pop(call_id, None)

    # ------------------------------------------------------------------ the two threads

    def _read_outputs(self) -> None:
        """Output thread: decode what the core sends; outputs to the sink, results to callers."""
        decode_outputs = msgspec.msgpack.Decoder(EngineCoreOutputs).decode
        decode_result = msgspec.msgpack.Decoder(UtilityResult).decode
        decode_error = msgspec.msgpack.Decoder(EngineCoreError).decode
        sock = self.output_socket
        while not self.closing and self.dead_cause is None:
            try:
                if not sock.poll(_POLL_MS):
                    continue
                type_frame, payload = sock.recv_multipart(copy=False)
                output_type = EngineCoreOutputType(type_frame.bytes)
                if output_type == EngineCoreOutputType.OUTPUTS:
                    self.sink.put(decode_outputs(payload.buffer))
                elif output_type == EngineCoreOutputType.UTILITY:
                    result = decode_result(payload.buffer)
                    with self.lock:
                        future, kind = self.pending_calls.pop(result.call_id, (None, None))
                    if future is None or future.done():
                        continue  # unknown, or cancelled by a caller that stopped waiting
                    if result.error is not None:
                        future.set_exception(RuntimeError(result.error))
                    else:
                        future.set_result(msgspec.msgpack.decode(result.result, type=kind))
                elif output_type == EngineCoreOutputType.DEAD:
                    self.mark_dead(rebuild_error(decode_error(payload.buffer)))
                    self.send_shutdown()  # the report is read: the core may exit now
            except Exception as exc:  # a message we cannot read: nothing after it is trusted
                if self.closing:
                    return
                self.mark_dead(exc)

    def _engine_exitcode(self) -> int | None:
        """None while the core runs, else how it ended (a process's exit code)."""
        return None if self.proc.is_alive() else self.proc.exitcode

    def _describe_end(self, exitcode: int | None) -> str:
        return f"process (pid {self.proc.pid}) {describe_exit(exitcode)}"

    def _wait_for_engine_end(self) -> int | None:
        """Block until the core ends; how it ended."""
        proc = self.proc
        multiprocessing.connection.wait([proc.sentinel])
        exitcode = proc.exitcode
        if exitcode is None:  # another thread reaped it first
            time.sleep(0.1)
            exitcode = proc.exitcode
        return exitcode

    def _watch_engine(self) -> None:
        """Monitor thread: a core that ends unasked makes the engine dead."""
        exitcode = self._wait_for_engine_end()
        if self.closing:
            return
        if exitcode == EXIT_CODE_REPORTED:
            # The core sent its own report; give the output thread time to read it (a
            # loaded machine can delay the message well past the process's exit).
            deadline = time.monotonic() + _REPORT_GRACE_S
            while self.dead_cause is None and time.monotonic() < deadline:
                time.sleep(0.05)
        self.mark_dead(RuntimeError(f"The engine core {self._describe_end(exitcode)}."))

    # ------------------------------------------------------------------ failure and exit

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

    def dead_error(self) -> EngineDeadError:
        error = EngineDeadError()
        error.__cause__ = self.dead_cause
        return error

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

    def shutdown(self) -> None:
        """Stop the core process (ask, then SIGTERM, then SIGKILL) and free the sockets."""
        with self.lock:
            if self.closed:
                return
            self.closing = self.closed = True
            calls, self.pending_calls = self.pending_calls, {}
        self._stop_engine()
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

    def _stop_engine(self) -> None:
        """Stop the core: ask, then SIGTERM, then SIGKILL."""
        proc = self.proc
        if self._config_sink is not None:
            self._config_sink.close()
        if proc is not None and proc.is_alive():
            if self.configured:
                self.send_shutdown()
                _stop_process(proc)
            else:  # never configured (the frontend failed to build the config): no engine
                proc.terminate()  # to stop yet, and SIGTERM ends it at once until then
                proc.join()


def _stop_process(proc: multiprocessing.process.BaseProcess) -> None:
    proc.join(_SHUTDOWN_GRACE_S)
    if proc.is_alive():
        logger.warning("The engine core did not exit when asked; sending SIGTERM")
        proc.terminate()
        proc.join(_SHUTDOWN_GRACE_S)
    if proc.is_alive():
        logger.warning("The engine core ignored SIGTERM; sending SIGKILL")
        proc.kill()
        proc.join()
