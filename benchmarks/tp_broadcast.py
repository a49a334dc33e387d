"""Micro-benchmark: what the tensor-parallel executor's per-step broadcast costs.

The executor sends each step's SchedulerOutput to every worker over its ZeroMQ broadcast
(message_queue.py); here worker processes only decode it and acknowledge. One figure is
the round trip (pickle, send to every reader, each unpickles and answers, both answers
read back): an upper bound of what a step pays before the forward pass can start. The
other is the pickle + unpickle alone.

Workload: ``--num-requests`` running requests in decode (one token each), the cached-
request diff the scheduler sends after the first step (a new block id for every 16th
request), with vLLM-style request ids; and, for comparison, the first step of the same
requests (whole prompts of ``--prompt-len`` tokens).

    nice -n 19 .venv/bin/python benchmarks/tp_broadcast.py --num-requests 256 --readers 2
"""

from __future__ import annotations

import argparse
import multiprocessing
import pickle
import shutil
import statistics
import tempfile
import time
import uuid

from minivllm.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from minivllm.executor.message_queue import ExecutorChannels, WorkerChannels
from minivllm.sampling_params import SamplingParams


def decode_step(req_ids: list[str], step: int) -> SchedulerOutput:
    n = len(req_ids)
    return SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=CachedRequestData(
            req_ids=list(req_ids),
            new_block_ids=[[1000 + i] if (i + step) % 16 == 0 else [] for i in range(n)],
            num_computed_tokens=[128 + step + i % 7 for i in range(n)],
        ),
        num_scheduled_tokens=dict.fromkeys(req_ids, 1),
        total_num_scheduled_tokens=n,
        finished_req_ids=set(),
    )


def first_step(req_ids: list[str], prompt_len: int) -> SchedulerOutput:
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    new = [
        NewRequestData(
            req_id=r,
            token_ids=list(range(i, i + prompt_len)),
            num_prompt_tokens=prompt_len,
            sampling_params=params,
            eos_token_id=2,
            block_ids=list(range(i * 9, i * 9 + prompt_len // 16 + 1)),
            num_computed_tokens=0,
        )
        for i, r in enumerate(req_ids)
    ]
    return SchedulerOutput(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=CachedRequestData(),
        num_scheduled_tokens=dict.fromkeys(req_ids, prompt_len),
        total_num_scheduled_tokens=prompt_len * len(req_ids),
        finished_req_ids=set(),
    )


def reader(rank: int, broadcast_address: str, reply_address: str) -> None:
    channels = WorkerChannels(broadcast_address, reply_address)
    channels.reply(-1, rank, True, None)
    while True:
        call_id, method, _args, _ = channels.recv_call()
        if method is None:
            break
        channels.reply(call_id, rank, True, None)
    channels.close()


def measure(channels: ExecutorChannels, readers: int, steps: list, iters: int) -> list[float]:
    times = []
    for i in range(iters):
        start = time.perf_counter()
        channels.broadcast((i, "execute_model", (steps[i % len(steps)],), None))
        for _ in range(readers):
            while channels.recv_reply(1000) is None:
                pass
        times.append(time.perf_counter() - start)
    return times


def codec_only(steps: list, iters: int) -> list[float]:
    times = []
    for i in range(iters):
        start = time.perf_counter()
        data = pickle.dumps((i, "execute_model", (steps[i % len(steps)],), None), protocol=5)
        pickle.loads(data)
        times.append(time.perf_counter() - start)
    return times


def summary(name: str, times: list[float], size: int) -> None:
    ms = sorted(t * 1e3 for t in times)
    p99 = ms[int(len(ms) * 0.99)]
    print(
        f"{name:<36} median {statistics.median(ms):.3f} ms  p99 {p99:.3f} ms  "
        f"({size / 1024:.1f} KiB)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--readers", type=int, default=2, help="worker processes (TP ranks)")
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--prompt-len", type=int, default=128)
    args = parser.parse_args()

    req_ids = [f"cmpl-{uuid.uuid4().hex}-0" for _ in range(args.num_requests)]
    decodes = [decode_step(req_ids, s) for s in range(16)]
    prefill = [first_step(req_ids, args.prompt_len)]

    ipc_dir = tempfile.mkdtemp(prefix="minivllm-bench-")
    channels = ExecutorChannels(ipc_dir=ipc_dir)
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=reader, args=(r, channels.broadcast_address, channels.reply_address))
        for r in range(args.readers)
    ]
    for p in procs:
        p.start()
    ready = 0
    while ready < args.readers or channels.num_subscribers < args.readers:
        channels.poll_subscriptions(0)
        if channels.recv_reply(10) is not None:
            ready += 1

    def size(so) -> int:
        return len(pickle.dumps((0, "execute_model", (so,), None), protocol=5))

    print(
        f"{args.num_requests} running requests, {args.readers} readers, "
        f"{args.iters} iterations (after {args.iters // 10} warm-up)"
    )
    measure(channels, args.readers, decodes, args.iters // 10)
    summary(
        "decode step: round trip",
        measure(channels, args.readers, decodes, args.iters),
        size(decodes[0]),
    )
    summary(
        "decode step: pickle + unpickle only", codec_only(decodes, args.iters), size(decodes[0])
    )
    summary(
        "first step (new requests): round trip",
        measure(channels, args.readers, prefill, max(50, args.iters // 20)),
        size(prefill[0]),
    )

    channels.broadcast((-2, None, (), None))
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
    channels.close()
    shutil.rmtree(ipc_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
