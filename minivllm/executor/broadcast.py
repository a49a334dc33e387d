"""What the multiprocess and Ray executors share: workers elsewhere that read every call
from one broadcast and answer on one reply queue (see message_queue.py).

A subclass starts the workers (each runs ``worker_proc.run_worker_loop``) and watches
them; this class sends calls, collects replies, and turns a worker's death or error into
``WorkerDiedError`` for the caller, the failure callbacks, and every later call. When a
worker dies, the others are stopped at once: a rank left alone would wait forever in
its next collective.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time

from minivllm.config import VllmConfig
from minivllm.core.sched_output import SchedulerOutput
from minivllm.executor.abstract import Executor, StepFuture, WorkerDiedError
from minivllm.executor.message_queue import ExecutorChannels, rebuild_error

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0  # until every worker has joined (not counting the model load)
_POLL_MS = 100


class BroadcastExecutor(Executor):
    def __init__(self, config: VllmConfig) -> None:
        super().__init__(config)
        self.world_size = config.parallel_config.world_size
        self.channels: ExecutorChannels | None = None
        self.worker_pids: list[int] = []
        self._call_ids = itertools.count()
        # Calls sent and not yet answered in full (the batch queue keeps several steps in
        # flight): call id -> the replies so far, by rank; wanted: how many it expects.
        self._replies: dict[int, dict[int, object]] = {}
        self._wanted: dict[int, int] = {}
        self._lock = threading.Lock()
        self._failure: BaseException | None = None
        self._closing = False
        try:
            self._start_workers()
            self._wait_for_workers()
            self._start_monitor()
            self.collective_rpc("load_model")
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------------ subclass hooks

    def _start_workers(self) -> None:
        """Bind self.channels, then start one worker per rank connected to them."""
        raise NotImplementedError

    def _workers_alive(self) -> bool:
        raise NotImplementedError

    def _start_monitor(self) -> None:
        """Start a thread that calls _on_worker_failure when a worker ends."""
        raise NotImplementedError

    def _stop_workers(self, graceful: bool) -> None:
        """End every worker: after the shutdown call when graceful, at once otherwise."""
        raise NotImplementedError

    # ------------------------------------------------------------------ calls

    def _wait_for_workers(self) -> None:
        """Every worker subscribed to the broadcast and said READY (or its start-up error)."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        pids: dict[int, int] = {}
        channels = self.channels
        while len(pids) < self.world_size or channels.num_subscribers < self.world_size:
            channels.poll_subscriptions(0)
            reply = channels.recv_reply(_POLL_MS)
            if reply is not None:
                _, rank, ok, value = reply
                if not ok:
                    raise rebuild_error(value, rank)
                pids[rank] = value
            elif not self._workers_alive():
                raise WorkerDiedError("A worker ended during start-up; see its log above.")
            if time.monotonic() > deadline:
                raise TimeoutError(f"The workers did not start in {STARTUP_TIMEOUT_S:.0f} s.")
        self.worker_pids = [pids[rank] for rank in range(self.world_size)]

    def collective_rpc(
        self, method: str, args: tuple = (), unique_reply_rank: int | None = None
    ) -> list:
        return self._wait(self._send(method, args, unique_reply_rank), method)

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> StepFuture:
        call_id = self._send("execute_model", (scheduler_output,), self.output_rank)
        return StepFuture(lambda: self._wait(call_id, "execute_model")[0])

    def _send(self, method: str, args: tuple, unique_reply_rank: int | None) -> int:
        """Broadcast a call; its id, for _wait."""
        self._check_alive()
        call_id = next(self._call_ids)
        self._replies[call_id] = {}
        self._wanted[call_id] = self.world_size if unique_reply_rank is None else 1
        self.channels.broadcast((call_id, method, args, unique_reply_rank))
        return call_id

    def _wait(self, call_id: int, method: str) -> list:
        """The call's results in rank order; replies to other calls in flight are kept
        for theirs (workers answer in call order, so those are earlier calls')."""
        results = self._replies[call_id]
        wanted = self._wanted[call_id]
        while len(results) < wanted:
            reply = self.channels.recv_reply(_POLL_MS)
            if reply is None:
                self._check_alive()
                continue
            reply_id, rank, ok, value = reply
            if not ok:
                error = rebuild_error(value, rank)
                self._fail(WorkerDiedError(f"Worker rank {rank} failed in {method}: {error}"))
                raise error
            if reply_id in self._replies:
                self._replies[reply_id][rank] = value
        del self._replies[call_id], self._wanted[call_id]
        return [results[rank] for rank in sorted(results)]

    def _check_alive(self) -> None:
        if self._failure is not None:
            raise WorkerDiedError(str(self._failure)) from self._failure
        if self._closing:
            raise WorkerDiedError("The executor was shut down.")

    # ------------------------------------------------------------------ failure and exit

    def _on_worker_failure(self, cause: BaseException) -> None:
        """From a monitor thread: a worker ended unasked."""
        if self._fail(cause):
            for callback in self._failure_callbacks:
                try:
                    callback(cause)
                except Exception:
                    logger.exception("An executor failure callback failed")

    def _fail(self, cause: BaseException) -> bool:
        """Record the first failure and stop the other workers; False if not the first."""
        with self._lock:
            if self._failure is not None or self._closing:
                return False
            self._failure = cause
        logger.error("%s; stopping the other workers", cause)
        self._stop_workers(graceful=False)
        return True

    def shutdown(self) -> None:
        with self._lock:
            if self._closing:
                return
            self._closing = True
            graceful = self._failure is None and self.channels is not None
        if graceful:
            self.channels.broadcast((next(self._call_ids), None, (), None))
        self._stop_workers(graceful=graceful)
        if self.channels is not None:
            self.channels.close()
