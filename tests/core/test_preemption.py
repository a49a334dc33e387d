"""Preemption by recompute: who is preempted under each policy, and how they resume."""

import pytest

from minivllm.core.request import RequestStatus
from minivllm.engine.messages import FinishReason
from tests.core.helpers import FakeEngine, make_request, make_scheduler, token_at

BS = 4


def done(req_id, prompt_len, max_tokens):
    return [token_at(req_id, prompt_len + i) for i in range(max_tokens)], FinishReason.LENGTH


def test_fcfs_preempts_the_newest_and_puts_it_at_the_front_of_waiting():
    eng = FakeEngine(make_scheduler(num_blocks=6, block_size=BS))
    sched = eng.sched
    for name, first in (("A", 1), ("B", 11), ("C", 21)):
        eng.add(make_request(name, list(range(first, first + 4)), max_tokens=12))
    steps = [eng.step() for _ in range(5)]  # A, B, C admitted; each fills 2 blocks
    assert all(not so.preempted_req_ids for so in steps)
    assert sched.kv_cache_manager.get_num_free_blocks() == 0
    eng.add(make_request("late", [40, 41], max_tokens=1))
    assert [r.request_id for r in sched.waiting] == ["late"]

    so = eng.step()  # A needs a third block: C, the newest, makes room for A and B
    assert so.preempted_req_ids == {"C"}
    assert "C" in so.finished_req_ids  # the runner drops its state
    assert so.num_scheduled_tokens == {"A": 1, "B": 1}
    c = next(r for r in sched.waiting if r.request_id == "C")
    assert [r.request_id for r in sched.waiting] == ["C", "late"]
    assert (c.status, c.num_computed_tokens, c.num_preemptions) == (RequestStatus.PREEMPTED, 0, 1)
    assert c.num_tokens == 4 + 5  # it keeps its prompt and the 5 tokens it produced
    assert sched.make_stats().num_preemptions == 1

    for _ in range(3):
        so = eng.step()
        assert not so.preempted_req_ids
    so = eng.step()  # A needs a fourth block: now B is the newest running request
    assert so.preempted_req_ids == {"B"}
    assert [r.request_id for r in sched.waiting] == ["B", "C", "late"]
    assert sched.make_stats().num_preemptions == 2

    eng.run()
    for name in "ABC":
        assert eng.result(name) == done(name, 4, 12)
    assert eng.result("late") == done("late", 2, 1)
    assert sched.kv_cache_manager.get_num_free_blocks() == 6


@pytest.mark.usefixtures("mixed_steps")
def test_priority_preempts_the_largest_priority_even_if_already_scheduled():
    eng = FakeEngine(make_scheduler(num_blocks=6, block_size=BS, policy="priority"))
    sched = eng.sched
    eng.add(make_request("A", list(range(1, 7)), max_tokens=8, priority=1, arrival_time=0))
    eng.step()  # A: 6 prompt tokens in blocks 0 and 1
    eng.add(make_request("D", [40, 41], max_tokens=8, priority=0, arrival_time=3))
    eng.add(make_request("C", [30, 31, 32, 33], max_tokens=8, priority=0, arrival_time=2))
    eng.add(make_request("B", [20, 21, 22, 23], max_tokens=8, priority=0, arrival_time=1))
    so = eng.step()
    # The waiting queue is ordered by (priority, arrival), not by insertion.
    assert [n.req_id for n in so.scheduled_new_reqs] == ["B", "C", "D"]
    assert [r.request_id for r in sched.running] == ["A", "B", "C", "D"]

    # A decodes in its own block, B takes the last free block, then C finds none: A, the
    # lowest priority, is preempted although it was already scheduled in this step; its
    # tokens leave the batch, and D, after C, is still scheduled.
    so = eng.step()
    assert so.preempted_req_ids == {"A"}
    assert so.num_scheduled_tokens == {"B": 1, "C": 1, "D": 1}
    assert so.total_num_scheduled_tokens == 3
    assert so.scheduled_cached_reqs.req_ids == ["B", "C", "D"]
    assert [r.request_id for r in sched.running] == ["B", "C", "D"]
    a = sched.requests["A"]
    assert (a.status, a.num_computed_tokens) == (RequestStatus.PREEMPTED, 0)
    assert a.num_tokens == 6 + 2

    eng.run()
    assert eng.result("A") == done("A", 6, 8)
    assert eng.result("B") == done("B", 4, 8)
    assert eng.result("C") == done("C", 4, 8)
    assert eng.result("D") == done("D", 2, 8)


def test_priority_ties_preempt_the_later_arrival():
    eng = FakeEngine(make_scheduler(num_blocks=6, block_size=BS, policy="priority"))
    sched = eng.sched
    # Same priority: "old" arrived first; insertion order is the reverse.
    eng.add(make_request("new", [20, 21, 22, 23], max_tokens=12, priority=3, arrival_time=5))
    eng.add(make_request("old", [10, 11, 12, 13], max_tokens=12, priority=3, arrival_time=1))
    eng.add(make_request("vip", [1, 2, 3, 4], max_tokens=12, priority=0, arrival_time=9))
    so = eng.step()
    assert [n.req_id for n in so.scheduled_new_reqs] == ["vip", "old", "new"]
    preempted = []
    while sched.has_unfinished_requests():
        so = eng.step()
        preempted += sorted(so.preempted_req_ids)
    assert preempted[:2] == ["new", "old"]
    for name in ("vip", "old", "new"):
        assert eng.result(name) == done(name, 4, 12)


def test_a_resumed_request_continues_where_it_was():
    eng = FakeEngine(make_scheduler(num_blocks=6, block_size=BS))
    sched = eng.sched
    for name, first in (("A", 1), ("B", 11), ("C", 21)):
        eng.add(make_request(name, list(range(first, first + 4)), max_tokens=12))
    while not sched.make_stats().num_preemptions:
        eng.step()
    c = sched.requests["C"]
    tokens_at_preemption = list(c.all_token_ids)
    resumed = None
    while resumed is None:
        so = eng.step()
        resumed = next((n for n in so.scheduled_new_reqs if n.req_id == "C"), None)
    # It is sent to the runner again, whole: prompt and the outputs it had made.
    assert resumed.token_ids[: len(tokens_at_preemption)] == tokens_at_preemption
    assert resumed.num_prompt_tokens == 4
    # Its blocks went to A and B, so all of it is recomputed, outputs included, in one go.
    assert resumed.num_computed_tokens == 0
    assert so.num_scheduled_tokens["C"] == len(resumed.token_ids)
    eng.run()
    assert eng.result("C") == done("C", 4, 12)


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_preemption_recomputes_from_scratch_without_or_with_cache(enable_prefix_caching):
    sched = make_scheduler(
        num_blocks=8,
        block_size=BS,
        max_num_batched_tokens=8,
        enable_prefix_caching=enable_prefix_caching,
    )
    eng = FakeEngine(sched)
    for i in range(5):
        eng.add(make_request(f"r{i}", [1, 2, 3, 4, 5] + [10 + i] * 3, max_tokens=10))
    eng.run()
    assert sched.make_stats().num_preemptions > 0
    for i in range(5):
        assert eng.result(f"r{i}") == done(f"r{i}", 8, 10)
    assert sched.kv_cache_manager.get_num_free_blocks() == 8
