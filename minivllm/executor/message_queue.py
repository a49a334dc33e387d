"""The executor's two channels to its workers: one broadcast out, one queue of replies back.

- Broadcast: the executor binds a ZeroMQ XPUB socket and every worker SUBscribes to it.
  A call is pickled once and sent once; ZeroMQ hands the same bytes to each worker (ipc
  between processes of one machine, TCP to Ray actors). PUB/SUB drops what is sent before
  a subscriber has joined, so the executor counts the subscriptions XPUB reports before
  its first call. No high-water mark: nothing is ever dropped.
- Replies: every worker PUSHes to one PULL socket the executor binds.

A call is ``(call_id, method, args, reply_rank)``; ``reply_rank`` None asks every rank for
its result, a rank number asks only that rank (a step's output comes from rank 0 alone).
A reply is ``(call_id, rank, ok, value)``; a failing worker always replies, with its
exception. Pickle, because both ends are this program and SchedulerOutput is already a
diff (new requests once, then block ids and counters).
"""

from __future__ import annotations

import os
import pickle
import traceback
from typing import Any

import zmq

from minivllm.utils.remote_errors import pickle_exception, rebuild_exception
from minivllm.utils.zmq_sockets import LOCALHOST, bind_socket

READY_CALL_ID = -1  # the reply a worker sends once it has joined: (-1, rank, True, pid)


class ExecutorChannels:
    """The executor's end: publishes calls, collects replies."""

    def __init__(self, host: str = LOCALHOST, ipc_dir: str | None = None) -> None:
        self.ctx = zmq.Context()
        self.publisher = self.ctx.socket(zmq.XPUB)
        self.publisher.setsockopt(zmq.SNDHWM, 0)
        self.publisher.setsockopt(zmq.XPUB_VERBOSE, 1)  # report every subscriber, not the first
        self.broadcast_address = bind_socket(
            self.publisher, os.path.join(ipc_dir, "broadcast") if ipc_dir else None, host
        )
        self.replies = self.ctx.socket(zmq.PULL)
        self.replies.setsockopt(zmq.RCVHWM, 0)
        self.reply_address = bind_socket(
            self.replies, os.path.join(ipc_dir, "replies") if ipc_dir else None, host
        )
        self.num_subscribers = 0

    def poll_subscriptions(self, timeout_ms: int) -> None:
        """Count the workers that have subscribed (XPUB reports b'\\x01' + topic)."""
        if self.publisher.poll(timeout_ms):
            event = self.publisher.recv()
            if event[:1] == b"\x01":
                self.num_subscribers += 1

    def broadcast(self, call: tuple) -> None:
        self.publisher.send(pickle.dumps(call, protocol=pickle.HIGHEST_PROTOCOL), copy=False)

    def recv_reply(self, timeout_ms: int) -> tuple | None:
        if not self.replies.poll(timeout_ms):
            return None
        return pickle.loads(self.replies.recv(copy=False).buffer)

    def close(self) -> None:
        self.publisher.close(linger=0)
        self.replies.close(linger=0)
        self.ctx.term()


class WorkerChannels:
    """A worker's end: reads every call, sends its replies."""

    def __init__(self, broadcast_address: str, reply_address: str) -> None:
        self.ctx = zmq.Context()
        self.subscriber = self.ctx.socket(zmq.SUB)
        self.subscriber.setsockopt(zmq.RCVHWM, 0)
        self.subscriber.setsockopt(zmq.SUBSCRIBE, b"")
        self.subscriber.connect(broadcast_address)
        self.sender = self.ctx.socket(zmq.PUSH)
        self.sender.setsockopt(zmq.SNDHWM, 0)
        self.sender.connect(reply_address)

    def recv_call(self, timeout_ms: int | None = None) -> tuple | None:
        """The next call; None when timeout_ms (None: wait forever) passes first."""
        if not self.subscriber.poll(timeout_ms):
            return None
        return pickle.loads(self.subscriber.recv(copy=False).buffer)

    def reply(self, call_id: int, rank: int, ok: bool, value: Any) -> None:
        try:
            data = pickle.dumps((call_id, rank, ok, value), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # an unpicklable result is the worker's failure
            data = pickle.dumps((call_id, rank, False, error_payload(exc)))
        self.sender.send(data, copy=False)

    def close(self) -> None:
        # Linger so that a last reply (an error) still reaches the executor.
        self.subscriber.close(linger=0)
        self.sender.close(linger=2000)
        self.ctx.term()


def error_payload(exc: BaseException) -> tuple[bytes | None, str, str]:
    """An exception to send: pickled when it round-trips, and always as text."""
    text = f"{type(exc).__qualname__}: {exc}"
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return pickle_exception(exc), text, tb


def rebuild_error(payload: tuple[bytes | None, str, str], rank: int) -> BaseException:
    pickled, text, tb = payload
    fallback = f"Worker rank {rank} failed: {text}"
    return rebuild_exception(pickled, fallback, tb, where=f"worker rank {rank}")
