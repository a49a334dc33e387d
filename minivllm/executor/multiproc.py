"""MultiprocExecutor: one worker process per tensor-parallel rank on this machine.

The workers are spawned children of the engine core's process. Calls go out over an ipc
broadcast and rank 0 answers each step; the ranks exchange activations among themselves
through torch.distributed (gloo on CPU, NCCL on GPU) at a free localhost port. A monitor
thread waits on the processes: if one ends unasked, the others are killed and the engine
is told. Each worker also exits by itself when its parent is gone (no orphans).
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import tempfile
import threading

from minivllm.distributed.parallel_state import get_open_port
from minivllm.executor.abstract import WorkerDiedError
from minivllm.executor.broadcast import BroadcastExecutor
from minivllm.executor.message_queue import ExecutorChannels
from minivllm.executor.worker_proc import worker_process_main
from minivllm.utils.process import describe_exit, spawn_process

logger = logging.getLogger(__name__)

_SHUTDOWN_GRACE_S = 5.0


class MultiprocExecutor(BroadcastExecutor):
    def _start_workers(self) -> None:
        self._ipc_dir = tempfile.mkdtemp(prefix="minivllm-tp-")
        self.channels = ExecutorChannels(ipc_dir=self._ipc_dir)
        init_method = f"tcp://127.0.0.1:{get_open_port()}"
        self.processes: list[multiprocessing.process.BaseProcess] = []
        for rank in range(self.world_size):
            proc = spawn_process(
                worker_process_main,
                name=f"Worker_TP{rank}",
                kwargs=dict(
                    parent_pid=os.getpid(),
                    config=self.config,
                    rank=rank,
                    distributed_init_method=init_method,
                    broadcast_address=self.channels.broadcast_address,
                    reply_address=self.channels.reply_address,
                ),
                daemon=True,
            )
            self.processes.append(proc)

    def _workers_alive(self) -> bool:
        return all(proc.is_alive() for proc in self.processes)

    def _start_monitor(self) -> None:
        threading.Thread(target=self._monitor, name="WorkerMonitor", daemon=True).start()

    def _monitor(self) -> None:
        by_sentinel = {proc.sentinel: (rank, proc) for rank, proc in enumerate(self.processes)}
        ended = multiprocessing.connection.wait(list(by_sentinel))
        if self._closing:
            return
        rank, proc = by_sentinel[ended[0]]
        proc.join(1.0)  # reap it, for its exit code
        self._on_worker_failure(
            WorkerDiedError(f"Worker rank {rank} (pid {proc.pid}) {describe_exit(proc.exitcode)}")
        )

    def _stop_workers(self, graceful: bool) -> None:
        for proc in getattr(self, "processes", []):
            if graceful:
                proc.join(_SHUTDOWN_GRACE_S)
            if proc.is_alive():
                if graceful:
                    logger.warning("Worker %s did not exit when asked; killing it", proc.name)
                proc.kill()
            proc.join(_SHUTDOWN_GRACE_S)
        if getattr(self, "_ipc_dir", None):
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
