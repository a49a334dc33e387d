"""Aborting a request frees its blocks by the next step, whatever state it is in."""

from minivllm.core.request import RequestStatus
from minivllm.engine.messages import FinishReason
from tests.core.helpers import FakeEngine, make_request, make_scheduler, token_at

BS = 4


def abort(eng, *req_ids):
    eng.sched.finish_requests(list(req_ids), RequestStatus.FINISHED_ABORTED)
    eng.sched.check_invariants()


def test_abort_a_waiting_request_that_never_ran():
    eng = FakeEngine(make_scheduler(num_blocks=8, block_size=BS, max_num_seqs=1))
    eng.add(make_request("run", list(range(1, 6)), max_tokens=3))
    eng.add(make_request("wait", list(range(1, 6)), max_tokens=3))
    eng.step()
    abort(eng, "wait")
    assert [r.request_id for r in eng.sched.waiting] == []
    so = eng.step()
    assert "wait" in so.finished_req_ids
    eng.run()
    assert "wait" not in eng.outputs
    assert eng.sched.kv_cache_manager.get_num_free_blocks() == 8


def test_abort_in_the_middle_of_a_chunked_prefill():
    eng = FakeEngine(make_scheduler(num_blocks=16, block_size=BS, max_num_batched_tokens=8))
    eng.add(make_request("long", list(range(1, 31)), max_tokens=2))
    eng.step()
    eng.step()
    assert eng.sched.requests["long"].num_computed_tokens == 16
    assert eng.sched.kv_cache_manager.get_num_free_blocks() == 12
    abort(eng, "long")
    assert eng.sched.kv_cache_manager.get_num_free_blocks() == 16
    assert not eng.sched.has_unfinished_requests()
    so = eng.sched.schedule()
    assert so.finished_req_ids == {"long"}
    # What it did compute stays cached for whoever comes next.
    eng.add(make_request("next", list(range(1, 31)), max_tokens=1))
    so = eng.step()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 16
    eng.run()
    assert eng.result("next") == ([token_at("next", 30)], FinishReason.LENGTH)


def test_abort_a_decoding_request_that_shares_blocks():
    eng = FakeEngine(make_scheduler(num_blocks=16, block_size=BS))
    eng.add(make_request("A", list(range(1, 11)), max_tokens=20))
    eng.add(make_request("B", list(range(1, 11)) + [99], max_tokens=4))
    eng.step()
    eng.step()
    pool = eng.sched.kv_cache_manager.block_pool
    shared = eng.sched.kv_cache_manager.get_block_ids("A")[:2]
    assert [pool.blocks[i].ref_cnt for i in shared] == [2, 2]
    abort(eng, "A")
    assert [pool.blocks[i].ref_cnt for i in shared] == [1, 1]
    eng.run()  # B still reads the shared KV correctly
    assert eng.result("B") == ([token_at("B", 11 + i) for i in range(4)], FinishReason.LENGTH)
    assert len(eng.outputs["A"]) == 2
    assert "A" not in eng.finish_reasons
    assert pool.get_num_free_blocks() == 16


def test_abort_a_preempted_request():
    eng = FakeEngine(make_scheduler(num_blocks=6, block_size=BS))
    for name, first in (("A", 1), ("B", 11), ("C", 21)):
        eng.add(make_request(name, list(range(first, first + 4)), max_tokens=12))
    while not eng.sched.make_stats().num_preemptions:
        eng.step()
    assert eng.sched.requests["C"].status == RequestStatus.PREEMPTED
    abort(eng, "C")
    assert "C" not in eng.sched.requests
    assert [r.request_id for r in eng.sched.waiting] == []
    eng.run()
    assert "C" not in eng.finish_reasons
    assert eng.sched.kv_cache_manager.get_num_free_blocks() == 6


def test_output_for_a_request_aborted_after_it_was_scheduled_is_dropped():
    eng = FakeEngine(make_scheduler(num_blocks=8, block_size=BS))
    eng.add(make_request("A", list(range(1, 6)), max_tokens=5))
    so = eng.sched.schedule()
    runner_output = eng.runner.execute_model(so)
    abort(eng, "A")
    out = eng.sched.update_from_output(so, runner_output)
    assert out.outputs == []
    assert eng.sched.kv_cache_manager.get_num_free_blocks() == 8
    assert eng.sched.schedule().finished_req_ids == {"A"}


def test_abort_of_unknown_or_finished_requests_is_a_no_op():
    eng = FakeEngine(make_scheduler(num_blocks=8, block_size=BS))
    eng.add(make_request("A", [1, 2, 3], max_tokens=1))
    eng.run()
    abort(eng, "A", "never-seen")
    assert eng.sched.schedule().finished_req_ids == {"A"}  # from its own finish
    assert eng.sched.schedule().finished_req_ids == set()
