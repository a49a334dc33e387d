"""EngineCoreProc: the engine core in its own process, behind two ZeroMQ sockets.

Three threads. The main thread runs the busy loop: take what the input queue holds (block
on it only when there is no work), step, put the step's outputs on the output queue. The
input thread receives and decodes messages into the input queue; the output thread encodes
and sends what the output queue holds. msgpack work and socket waits thus overlap the
forward pass, which releases the GIL.

The process connects to the sockets its frontend bound. The first message it sends is the
handshake: READY, or DEAD with the start-up error. It exits when the frontend says
SHUTDOWN, on SIGTERM, and when its parent process is gone (no orphans).
"""

from __future__ import annotations

import gc
import logging
import multiprocessing.connection
import os
import queue
import shutil
import signal
import sys
import threading
import time
import traceback
from typing import Any

import msgspec
import zmq

from minivllm import envs
from minivllm.config import VllmConfig
from minivllm.engine.exceptions import make_error_report
from minivllm.engine.messages import (
    EngineCoreOutputType,
    EngineCoreReady,
    EngineCoreRequest,
    EngineCoreRequestType,
    UtilityRequest,
    UtilityResult,
)
from minivllm.utils.process import parent_alive, set_cpu_threads

logger = logging.getLogger(__name__)

# Exit code of a core that reported its failure to the frontend itself (a DEAD message):
# the frontend's process monitor then has nothing to add.
EXIT_CODE_REPORTED = 70

# EngineCore methods the frontend may call through a UTILITY message.
UTILITY_METHODS = frozenset(
    {"get_stats", "reset_prefix_cache", "profile", "add_lora", "sleep", "wake_up", "is_sleeping"}
)

_PARENT_POLL_S = 0.5
# After SHUTDOWN, how long a step in progress may delay the exit. Nothing it computes is
# wanted any more (the frontend has ended its requests), and a step can take seconds on a
# loaded machine, while the server must exit within its shutdown timeout plus 2 s.
_SHUTDOWN_STEP_GRACE_S = 0.5
_STOP = object()  # output-queue sentinel: flush and close the output socket
_RAISE = object()  # input-queue marker: raise the payload in the busy loop
_REJECT = object()  # input-queue marker: fail the request with this id alone


class _Shutdown(Exception):
    """Raised in the main thread to leave the busy loop (SIGTERM, parent gone)."""


def run_engine_core(
    config_source: multiprocessing.connection.Connection,
    input_address: str,
    output_address: str,
    parent_pid: int,
    ipc_dir: str | None = None,
) -> None:
    """Entry point of the engine core process (multiprocessing, spawn context).

    The frontend starts this process before it has built the VllmConfig, which then comes
    through ``config_source``: meanwhile this process imports the engine (torch,
    transformers, the model code: seconds), while the frontend imports its own share.
    """
    # Ctrl-C reaches the whole process group; the frontend decides what it means and
    # shuts this process down, so the core itself ignores it. Until the config comes,
    # SIGTERM ends the process at once (a frontend that failed to build it sends one).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _import_engine_at_low_priority(envs.MINIVLLM_ENGINE_IMPORT_NICE)
    try:
        vllm_config = config_source.recv()
    except EOFError:  # the frontend is gone, or gave up before sending it
        os._exit(0)
    config_source.close()
    signal.signal(signal.SIGTERM, _raise_shutdown)
    # With one rank the model runs in this process; with more, each worker sets its own.
    # Data-parallel engine cores on one machine share its cores.
    parallel = vllm_config.parallel_config
    if parallel.world_size == 1:
        set_cpu_threads(parallel.data_parallel_rank, parallel.data_parallel_size)
    elif envs.MINIVLLM_CPU_OMP_THREADS_BIND == "auto":
        set_cpu_threads()
    proc = EngineCoreProc(input_address, output_address, parent_pid, ipc_dir)
    exit_code = proc.run(vllm_config)
    # os._exit: skip interpreter teardown (torch, zmq contexts); everything is flushed.
    os._exit(exit_code)


def _import_engine() -> None:
    """What building the core imports, imported before its config arrives."""
    import transformers.configuration_utils  # noqa: F401  (the config's classes)

    import minivllm.engine.core  # noqa: F401  (torch, the scheduler, the executor)
    import minivllm.worker.worker  # noqa: F401  (the model runner, the layers)


def _import_engine_at_low_priority(nice: int) -> None:
    """_import_engine, on a thread of its own whose CPU priority is ``nice`` lower.

    On Linux a nice value is a thread's: an unprivileged process may raise its own but
    never lower it again, so the imports (seconds of CPU, while other models' engine cores
    may be serving on the same cores) run on a thread that ends with them, and the core
    builds and serves on its main thread at its normal priority. Elsewhere, or with 0, they
    run here.
    """

    def import_engine() -> None:
        try:
            _import_engine()
        except Exception:
            pass  # the build imports them again, and its failure is reported to the frontend

    if nice <= 0 or not sys.platform.startswith("linux"):
        import_engine()
        return

    def import_niced() -> None:
        try:  # PRIO_PROCESS with a thread id: that thread only (Linux)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        except OSError:
            pass
        import_engine()

    thread = threading.Thread(target=import_niced, name="EngineCoreImport")
    thread.start()
    thread.join()


def _raise_shutdown(signum, frame) -> None:
    raise _Shutdown(f"signal {signum}")


class EngineCoreProc:
    def __init__(
        self,
        input_address: str,
        output_address: str,
        parent_pid: int | None,
        ipc_dir: str | None,
    ) -> None:
        """parent_pid: exit when that process is gone; None where something else ends the
        core with its frontend (Ray ends an actor with its owner)."""
        self.input_queue: queue.Queue = queue.Queue()
        self.output_queue: queue.Queue = queue.Queue()
        self.parent_pid = parent_pid
        self.ipc_dir = ipc_dir
        self.engine_core = None
        self._shutdown_requested = False
        self._busy_loop_done = False
        self._ctx = zmq.Context()
        self._encoder = msgspec.msgpack.Encoder()
        self._input_thread = threading.Thread(
            target=self._process_input_socket,
            args=(input_address,),
            name="EngineCoreInput",
            daemon=True,
        )
        self._output_thread = threading.Thread(
            target=self._process_output_socket,
            args=(output_address,),
            name="EngineCoreOutput",
            daemon=True,
        )

    def run(self, vllm_config: VllmConfig) -> int:
        """Build the core, answer the handshake, run the busy loop; return the exit code."""
        self._output_thread.start()
        # The input thread connects now, and watches the parent while the model loads;
        # what arrives before the core is built waits in the input queue.
        self._input_thread.start()
        try:
            from minivllm.engine.core import EngineCore

            self.engine_core = EngineCore(vllm_config)
        except BaseException as exc:
            logger.exception("The engine core failed to start")
            return self._report_and_stop(exc, during_startup=True)
        # A worker that dies while the core waits for requests fails the core at once.
        self.engine_core.executor.register_failure_callback(
            lambda cause: self.input_queue.put((_RAISE, cause))
        )
        # vLLM's: the start-up heap (the model's modules, the tokenizer, torch's own objects)
        # becomes permanent, so that the collector's full passes during serving, each a pause
        # of every step, no longer walk it. Only here, in the core's own process: frozen
        # objects are never collected, which an in-process engine's caller would not expect.
        gc.collect()
        gc.freeze()
        self._send(
            EngineCoreOutputType.READY,
            EngineCoreReady(
                pid=os.getpid(),
                num_blocks=self.engine_core.num_blocks,
                weight_memory_bytes=self.engine_core.weight_memory_bytes,
                step_time_model=self.engine_core.step_time_model(),
            ),
        )
        try:
            self.run_busy_loop()
        except _Shutdown as reason:
            logger.info("Engine core shutting down: %s", reason)
        except BaseException as exc:
            logger.exception("The engine core hit a fatal error")
            return self._report_and_stop(exc, during_startup=False)
        finally:
            self._busy_loop_done = True
        self._stop_output()
        self.engine_core.shutdown()
        return 0

    # ------------------------------------------------------------------ the busy loop

    def run_busy_loop(self) -> None:
        while not self._shutdown_requested:
            self._process_input_queue()
            self._process_engine_step()

    def _process_input_queue(self) -> None:
        core = self.engine_core
        # Nothing to step: sleep until a message comes.
        while not self._shutdown_requested and not core.has_unfinished_requests():
            self._handle(*self.input_queue.get())
        # Work to do: take what has arrived, without waiting.
        while not self._shutdown_requested:
            try:
                item = self.input_queue.get_nowait()
            except queue.Empty:
                return
            self._handle(*item)

    def _process_engine_step(self) -> None:
        if self.engine_core.has_unfinished_requests():
            self._send(EngineCoreOutputType.OUTPUTS, self.engine_core.step())

    def _handle(self, request_type: EngineCoreRequestType, payload: Any) -> None:
        core = self.engine_core
        if request_type == EngineCoreRequestType.ADD:
            core.add_request(payload)
        elif request_type == EngineCoreRequestType.ABORT:
            core.abort_requests(payload)
        elif request_type == EngineCoreRequestType.UTILITY:
            self._call_utility(payload)
        elif request_type == EngineCoreRequestType.SHUTDOWN:
            self._shutdown_requested = True
        elif request_type is _REJECT:
            core.scheduler.reject_request(payload)
        elif request_type is _RAISE:
            raise payload

    def _call_utility(self, call: UtilityRequest) -> None:
        try:
            if call.method not in UTILITY_METHODS:
                raise ValueError(f"unknown engine core method {call.method!r}")
            value = getattr(self.engine_core, call.method)(*call.args)
            result = UtilityResult(call.call_id, result=msgspec.Raw(self._encoder.encode(value)))
        except Exception as exc:  # the caller gets the error; the core carries on
            result = UtilityResult(call.call_id, error=f"{type(exc).__name__}: {exc}")
        self._send(EngineCoreOutputType.UTILITY, result)

    # ------------------------------------------------------------------ failure and exit

    def _send(self, output_type: EngineCoreOutputType, payload: Any) -> None:
        self.output_queue.put((output_type, payload))

    def _report_and_stop(self, exc: BaseException, during_startup: bool) -> int:
        report = make_error_report(exc, during_startup, traceback.format_exc())
        self._send(EngineCoreOutputType.DEAD, report)
        self._stop_output()
        self._wait_for_frontend()
        if self.engine_core is not None:
            try:
                self.engine_core.shutdown()
            except Exception:
                logger.exception("Engine core shutdown failed")
        return EXIT_CODE_REPORTED

    def _wait_for_frontend(self, timeout: float = 5.0) -> None:
        """Stay alive until the frontend has read the report and says SHUTDOWN (or a
        timeout): ZeroMQ's IO thread still holds an unsent report, and exiting drops it."""
        deadline = time.monotonic() + timeout
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                request_type, _ = self.input_queue.get(timeout=remaining)
            except queue.Empty:
                return
            if request_type in (EngineCoreRequestType.SHUTDOWN, _RAISE):
                return

    def _stop_output(self) -> None:
        """Flush the output queue to the socket, then close it."""
        self.output_queue.put(_STOP)
        self._output_thread.join(timeout=10)

    # ------------------------------------------------------------------ IO threads

    def _process_input_socket(self, address: str) -> None:
        try:
            self._read_input_socket(address)
        except BaseException as exc:  # the busy loop fails with it, and reports it
            self.input_queue.put((_RAISE, exc))

    def _read_input_socket(self, address: str) -> None:
        decode_add = msgspec.msgpack.Decoder(EngineCoreRequest).decode
        decode_abort = msgspec.msgpack.Decoder(list[str]).decode
        decode_utility = msgspec.msgpack.Decoder(UtilityRequest).decode
        sock = self._ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.connect(address)
        next_parent_check = 0.0
        while True:
            if sock.poll(int(_PARENT_POLL_S * 1000)):
                type_frame, payload = sock.recv_multipart(copy=False)
                request_type = EngineCoreRequestType(type_frame.bytes)
                if request_type == EngineCoreRequestType.ADD:
                    try:
                        item = decode_add(payload.buffer)
                    except msgspec.ValidationError as exc:
                        request_type, item = _REJECT, undecodable_request_id(payload.buffer, exc)
                elif request_type == EngineCoreRequestType.ABORT:
                    item = decode_abort(payload.buffer)
                elif request_type == EngineCoreRequestType.UTILITY:
                    item = decode_utility(payload.buffer)
                else:
                    item = None
                self.input_queue.put((request_type, item))
                if request_type == EngineCoreRequestType.SHUTDOWN:
                    threading.Thread(target=self._exit_if_still_stepping, daemon=True).start()
                    break
            now = time.monotonic()
            if self.parent_pid is not None and now >= next_parent_check:
                next_parent_check = now + _PARENT_POLL_S
                if not parent_alive(self.parent_pid):
                    self._on_parent_gone()
                    break
        sock.close(linger=0)

    def _exit_if_still_stepping(self) -> None:
        """Exit if a step keeps the busy loop from seeing SHUTDOWN for long (see above)."""
        time.sleep(_SHUTDOWN_STEP_GRACE_S)
        if not self._busy_loop_done:
            logger.info("Engine core exiting without finishing its step (shutdown)")
            os._exit(0)

    def _on_parent_gone(self) -> None:
        logger.warning("The frontend process %d is gone; the engine core exits", self.parent_pid)
        if self.ipc_dir:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
        self.input_queue.put((_RAISE, _Shutdown("the frontend process is gone")))

        def exit_soon() -> None:  # if a long step (or a hang) keeps the loop from seeing it
            time.sleep(5)
            os._exit(0)

        threading.Thread(target=exit_soon, daemon=True).start()

    def _process_output_socket(self, address: str) -> None:
        try:
            self._write_output_socket(address)
        except BaseException:
            # Nothing can reach the frontend any more: exit, and its monitor reports it.
            logger.exception("The engine core's output thread failed")
            os._exit(1)

    def _write_output_socket(self, address: str) -> None:
        # A context of its own: its term() returns once ZeroMQ has written what is queued
        # (or the linger expired). Closing a socket does not wait, and the process exits
        # right after the last message (a DEAD report), which must not be lost.
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.connect(address)
        encode = self._encoder.encode
        while True:
            item = self.output_queue.get()
            if item is _STOP:
                break
            output_type, payload = item
            sock.send_multipart((output_type.value, encode(payload)), copy=False)
        sock.close(linger=5000)
        ctx.term()


def undecodable_request_id(buffer, error: msgspec.ValidationError) -> str:
    """The id of a request the frontend let through with a field of the wrong type (the
    array's first item), to fail it alone where raising killed the engine for all."""
    fields = msgspec.msgpack.decode(buffer)
    request_id = fields[0] if isinstance(fields, list) and fields else None
    if not isinstance(request_id, str):
        raise error  # no request to fail: the frontend sent something else entirely
    logger.error("Request %s could not be decoded; it alone ends: %s", request_id, error)
    return request_id
