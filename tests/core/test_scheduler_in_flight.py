"""The batch queue's hook in the scheduler: a request whose step is in flight is neither
scheduled nor preempted until its output is in."""

from __future__ import annotations

import pytest

from minivllm.core.request import RequestStatus
from tests.core.helpers import fake_runner_output, make_request, make_scheduler

BS = 4


@pytest.mark.usefixtures("mixed_steps")
def test_a_request_in_flight_is_not_scheduled_again():
    sched = make_scheduler(num_blocks=32, block_size=BS, max_num_batched_tokens=4)
    sched.in_flight = set()
    sched.add_request(make_request("A", list(range(1, 11)), max_tokens=3))  # 3 chunks of 4
    first = sched.schedule()
    assert first.num_scheduled_tokens == {"A": 4}
    assert sched.in_flight == {"A"}
    sched.add_request(make_request("B", [20, 21], max_tokens=3))
    second = sched.schedule()  # A's next chunk waits for its first: B alone
    assert second.num_scheduled_tokens == {"B": 2}
    assert sched.schedule().total_num_scheduled_tokens == 0  # both in flight
    sched.update_from_output(first, fake_runner_output(first, sched))
    assert sched.in_flight == {"B"}
    assert sched.schedule().num_scheduled_tokens == {"A": 4}


def test_a_request_in_flight_is_never_the_victim():
    sched = make_scheduler(num_blocks=2, block_size=BS, enable_prefix_caching=False)
    sched.in_flight = set()
    sched.add_request(make_request("old", [1, 2, 3, 4], max_tokens=4))
    first = sched.schedule()  # old's 4 prompt tokens fill block 0
    sched.add_request(make_request("new", [5, 6, 7, 8], max_tokens=4))
    second = sched.schedule()  # new fills the last block; its step is in flight
    assert second.num_scheduled_tokens == {"new": 4}
    sched.update_from_output(first, fake_runner_output(first, sched))
    # old's sampled token needs a second block. FCFS would take new's (the newest); it is
    # in flight, so old gives its own back instead.
    third = sched.schedule()
    assert third.preempted_req_ids == {"old"}
    assert not third.num_scheduled_tokens
    assert sched.requests["new"].status == RequestStatus.RUNNING
    sched.update_from_output(second, fake_runner_output(second, sched))
    sched.check_invariants()
    assert sched.in_flight == set()


def test_without_the_hook_the_newest_is_preempted():
    """The same steps one at a time (no batch queue): FCFS takes the newest, as before."""
    sched = make_scheduler(num_blocks=2, block_size=BS, enable_prefix_caching=False)
    sched.add_request(make_request("old", [1, 2, 3, 4], max_tokens=4))
    first = sched.schedule()
    sched.add_request(make_request("new", [5, 6, 7, 8], max_tokens=4))
    sched.update_from_output(first, fake_runner_output(first, sched))
    second = sched.schedule()
    sched.update_from_output(second, fake_runner_output(second, sched))
    third = sched.schedule()
    assert third.preempted_req_ids == {"new"}
