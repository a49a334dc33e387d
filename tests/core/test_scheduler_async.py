"""Async scheduling in the scheduler: the next token is scheduled while the last is in
flight (placeholders), never past max_tokens or max_model_len, and a request that samples
from its own outputs on the host makes the engine wait."""

from minivllm.core.request import RequestStatus
from minivllm.engine.messages import FinishReason
from tests.core.helpers import (
    EOS,
    AsyncFakeEngine,
    FakeModelRunner,
    fake_runner_output,
    make_request,
    make_scheduler,
    token_at,
)


def async_scheduler(**kwargs):
    return make_scheduler(async_scheduling=True, **kwargs)


def test_the_next_token_is_scheduled_before_the_last_is_back():
    sched = async_scheduler()
    sched.add_request(make_request("A", [1, 2, 3], max_tokens=8))
    first = sched.schedule()
    assert first.num_scheduled_tokens == {"A": 3}
    a = sched.requests["A"]
    assert (a.num_computed_tokens, a.num_output_placeholders) == (3, 1)
    second = sched.schedule()  # the prompt's sample is still in flight
    assert second.num_scheduled_tokens == {"A": 1}
    assert (a.num_computed_tokens, a.num_output_placeholders) == (4, 2)
    sched.update_from_output(first, fake_runner_output(first, sched, token=9))
    assert (a.all_token_ids, a.num_output_placeholders) == ([1, 2, 3, 9], 1)


def test_placeholders_stop_at_max_tokens_and_max_model_len():
    sched = async_scheduler(max_model_len=8)
    sched.add_request(make_request("short", [1, 2], max_tokens=2))
    sched.add_request(make_request("long", [1, 2, 3, 4, 5, 6], max_tokens=100))
    sched.schedule()  # short: its 1st output in flight; long: its 7th token of 8
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"short": 1, "long": 1}  # long's 8th: its last
    # short's 2 tokens and long's 8 are all in flight: nothing more to schedule.
    assert not sched.schedule().num_scheduled_tokens


def test_a_request_that_reads_its_outputs_on_the_host_makes_steps_wait():
    sched = async_scheduler()
    sched.add_request(make_request("plain", [1, 2], max_tokens=4))
    assert not sched.needs_previous_outputs()
    sched.add_request(make_request("penalized", [1, 2], max_tokens=1, repetition_penalty=1.2))
    assert sched.needs_previous_outputs()
    so = sched.schedule()
    sched.update_from_output(so, fake_runner_output(so, sched))  # penalized is done
    assert "penalized" not in sched.requests
    assert not sched.needs_previous_outputs()
    sched.finish_requests("plain", RequestStatus.FINISHED_ABORTED)
    assert make_scheduler().needs_previous_outputs()  # without async, every step waits


def test_preemption_drops_the_token_in_flight_and_recomputes_it():
    eng = AsyncFakeEngine(async_scheduler(num_blocks=6, block_size=4))
    for name, first in (("A", 1), ("B", 11), ("C", 21)):
        eng.add(make_request(name, list(range(first, first + 4)), max_tokens=12))
    eng.run()
    assert eng.sched.make_stats().num_preemptions > 0
    for name in "ABC":
        assert eng.result(name) == (
            [token_at(name, 4 + i) for i in range(12)],
            FinishReason.LENGTH,
        )


def test_the_token_computed_after_a_stop_is_dropped():
    # A samples EOS at its third output; the step already launched after it is wasted.
    def sample(req_id: str, position: int) -> int:
        return EOS if position == 2 + 3 - 1 else 5

    sched = async_scheduler()
    eng = AsyncFakeEngine(sched, FakeModelRunner(4, sample))
    request = make_request("A", [1, 2], max_tokens=10)
    request.sampling_params.ignore_eos = False
    eng.add(request)
    eng.run()
    assert eng.result("A") == ([5, 5, EOS], FinishReason.STOP)
    assert sched.kv_cache_manager.get_num_free_blocks() == 64
