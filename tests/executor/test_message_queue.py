"""The executor's broadcast and reply channels, with reader threads standing in for workers."""

from __future__ import annotations

import threading

import pytest

from minivllm.executor.message_queue import (
    ExecutorChannels,
    WorkerChannels,
    error_payload,
    rebuild_error,
)
from minivllm.utils.remote_errors import RemoteTraceback

READERS = 3


def join(channels: ExecutorChannels, readers: int) -> None:
    """What the executor does at start-up: every reader subscribed and said hello."""
    hellos = 0
    while hellos < readers or channels.num_subscribers < readers:
        channels.poll_subscriptions(0)
        if channels.recv_reply(50) is not None:
            hellos += 1


def echo_reader(rank: int, channels: ExecutorChannels, seen: list) -> None:
    worker = WorkerChannels(channels.broadcast_address, channels.reply_address)
    worker.reply(-1, rank, True, None)
    while True:
        call_id, method, args, reply_rank = worker.recv_call()
        if method is None:
            break
        seen.append(call_id)
        if reply_rank is None or reply_rank == rank:
            worker.reply(call_id, rank, True, (method, args))
    worker.close()


@pytest.mark.parametrize("ipc", [True, False])
def test_every_reader_gets_every_call_in_order(tmp_path, ipc):
    channels = ExecutorChannels(ipc_dir=str(tmp_path) if ipc else None)
    assert channels.broadcast_address.startswith("ipc://" if ipc else "tcp://127.0.0.1:")
    seen = [[] for _ in range(READERS)]
    threads = [
        threading.Thread(target=echo_reader, args=(r, channels, seen[r])) for r in range(READERS)
    ]
    for t in threads:
        t.start()
    join(channels, READERS)
    assert channels.num_subscribers == READERS
    for call_id in range(50):
        reply_rank = 0 if call_id % 2 else None
        channels.broadcast((call_id, "step", ({"n": call_id},), reply_rank))
        wanted = 1 if reply_rank == 0 else READERS
        replies = [channels.recv_reply(5000) for _ in range(wanted)]
        assert {r[0] for r in replies} == {call_id}
        assert all(r[2] and r[3] == ("step", ({"n": call_id},)) for r in replies)
        assert {r[1] for r in replies} == ({0} if reply_rank == 0 else set(range(READERS)))
    channels.broadcast((50, None, (), None))
    for t in threads:
        t.join(5)
    assert seen == [list(range(50))] * READERS
    assert channels.recv_reply(100) is None  # nothing unasked came back
    channels.close()


def test_a_workers_error_comes_back_with_its_type_and_traceback():
    try:
        raise ValueError("max_model_len is too long")
    except ValueError as exc:
        payload = error_payload(exc)
    error = rebuild_error(payload, rank=1)
    assert isinstance(error, ValueError) and str(error) == "max_model_len is too long"
    assert isinstance(error.__cause__, RemoteTraceback)
    assert "worker rank 1" in str(error.__cause__) and "raise ValueError" in str(error.__cause__)


def test_an_unpicklable_error_comes_back_as_text():
    class Local(Exception):  # defined in a function: pickle cannot find it by name
        pass

    try:
        raise Local("odd")
    except Local as exc:
        payload = error_payload(exc)
    assert payload[0] is None
    error = rebuild_error(payload, rank=0)
    assert isinstance(error, RuntimeError) and "Local: odd" in str(error)
