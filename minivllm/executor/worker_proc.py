"""The loop a worker runs in its own process or Ray actor: read a call, run it, reply.

Start-up: connect to the executor's channels, join the tensor-parallel group, say READY
(or send the error). Then every broadcast call runs on the ``Worker``; the reply goes
back when the call asks for this rank's result, or when the call failed. A call whose
method is None ends the loop.
"""

from __future__ import annotations

import logging
import os
import signal

from minivllm.config import VllmConfig
from minivllm.executor.message_queue import READY_CALL_ID, WorkerChannels, error_payload
from minivllm.utils.process import exit_when_orphaned, set_cpu_threads

logger = logging.getLogger(__name__)


def run_worker_loop(
    config: VllmConfig,
    rank: int,
    distributed_init_method: str,
    broadcast_address: str,
    reply_address: str,
) -> None:
    from minivllm.worker.worker import Worker  # torch and the model code load here

    channels = WorkerChannels(broadcast_address, reply_address)
    try:
        worker = Worker(config, rank, distributed_init_method)
        worker.init_device()
    except BaseException as exc:
        logger.exception("Worker rank %d failed to start", rank)
        channels.reply(READY_CALL_ID, rank, False, error_payload(exc))
        channels.close()
        return
    channels.reply(READY_CALL_ID, rank, True, os.getpid())
    while True:
        call = channels.recv_call()
        call_id, method, args, reply_rank = call
        if method is None:
            break
        try:
            result = getattr(worker, method)(*args)
        except BaseException as exc:
            logger.exception("Worker rank %d failed in %s", rank, method)
            channels.reply(call_id, rank, False, error_payload(exc))
            continue
        if reply_rank is None or reply_rank == rank:
            channels.reply(call_id, rank, True, result)
    worker.shutdown()
    channels.close()


def worker_process_main(parent_pid: int, **kwargs) -> None:
    """Entry point of a worker process (multiprocessing, spawn context)."""
    # Ctrl-C reaches the whole process group: the engine decides, and stops us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parallel = kwargs["config"].parallel_config  # the ranks of every engine core here
    world, replicas = parallel.world_size, parallel.data_parallel_size
    set_cpu_threads(parallel.data_parallel_rank * world + kwargs["rank"], world * replicas)
    exit_when_orphaned(parent_pid)
    run_worker_loop(**kwargs)
    # Skip interpreter teardown (torch, gloo, zmq): everything is flushed.
    os._exit(0)
