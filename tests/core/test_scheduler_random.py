"""Random workloads against a small pool: every invariant holds after every step.

Shared prefixes, random prompt lengths, chunked prefill, both policies, salts, prompt
logprobs and random aborts; the fake runner checks that every position a request attends
to holds its own prefix's KV. At the end every block is free and every request that was
not aborted has exactly its max_tokens outputs.
"""

import random

import pytest

from minivllm.core.request import RequestStatus
from minivllm.engine.messages import FinishReason
from tests.core.helpers import AsyncFakeEngine, FakeEngine, make_request, make_scheduler, token_at

MAX_MODEL_LEN = 72
NUM_STEPS = 400
ARRIVALS_UNTIL = 300


def random_prompt(rng: random.Random, prefixes: list[list[int]]) -> list[int]:
    prefix = rng.choice(prefixes)[: rng.randint(0, 40)]
    return prefix + [rng.randint(1, 50) for _ in range(rng.randint(1, 12))]


@pytest.mark.parametrize(
    "prefill_first, async_scheduling", [("1", False), ("0", False), ("0", True)]
)
@pytest.mark.parametrize("seed", range(12))
def test_random_workload_keeps_every_invariant(seed, prefill_first, async_scheduling, monkeypatch):
    monkeypatch.setenv("MINIVLLM_PREFILL_FIRST", prefill_first)
    rng = random.Random(seed)
    block_size = rng.choice([2, 4, 8])
    min_blocks = -(-MAX_MODEL_LEN // block_size)
    num_blocks = rng.randint(min_blocks, min_blocks + 16)
    caching = seed % 4 != 3
    sched = make_scheduler(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_batched_tokens=rng.choice([8, 16, 32, 128]),
        max_num_seqs=rng.choice([3, 8, 16]),
        max_model_len=MAX_MODEL_LEN,
        enable_prefix_caching=caching,
        policy="priority" if seed % 2 else "fcfs",
        hash_algo=rng.choice(["sha256", "builtin"]),
        async_scheduling=async_scheduling,
    )
    eng = (AsyncFakeEngine if async_scheduling else FakeEngine)(sched)
    prefixes = [[rng.randint(1, 50) for _ in range(40)] for _ in range(3)]
    wanted: dict[str, tuple[int, int]] = {}  # req_id -> (prompt length, max_tokens)
    aborted: set[str] = set()

    for step_no in range(NUM_STEPS):
        if step_no < ARRIVALS_UNTIL and rng.random() < 0.5:
            for _ in range(rng.randint(1, 2)):
                req_id = f"r{len(wanted)}"
                prompt = random_prompt(rng, prefixes)
                max_tokens = rng.randint(1, 16)
                params = {"prompt_logprobs": 1} if rng.random() < 0.05 else {}
                eng.add(
                    make_request(
                        req_id,
                        prompt,
                        max_tokens=max_tokens,
                        priority=rng.randint(0, 3),
                        arrival_time=step_no + rng.random(),
                        cache_salt=rng.choice([None, None, None, "tenant"]),
                        **params,
                    )
                )
                wanted[req_id] = (len(prompt), max_tokens)
        if sched.requests and rng.random() < 0.04:
            victim = rng.choice(sorted(sched.requests))
            sched.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
            sched.check_invariants()
            aborted.add(victim)
        if eng.busy():
            eng.step()
    eng.run()

    assert not sched.requests and not sched.running and not sched.waiting
    assert sched.kv_cache_manager.get_num_free_blocks() == num_blocks
    assert all(b.ref_cnt == 0 for b in sched.kv_cache_manager.block_pool.blocks)
    for req_id, (prompt_len, max_tokens) in wanted.items():
        if req_id in aborted:
            assert req_id not in eng.finish_reasons
            continue
        outputs, reason = eng.result(req_id)
        assert reason == FinishReason.LENGTH, req_id
        assert outputs == [token_at(req_id, prompt_len + i) for i in range(max_tokens)], req_id

    if async_scheduling:  # most steps were scheduled with the previous one in flight
        assert eng.overlapped > NUM_STEPS // 2, eng.overlapped
    stats = sched.make_stats()
    assert stats.num_preemptions > 0, "the workload should overflow the pool"
    if caching:
        assert stats.prefix_cache_hits > 0, "the workload should share prefixes"
    else:
        assert stats.prefix_cache_queries == 0
