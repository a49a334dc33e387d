import pytest

from minivllm.core.request import RequestStatus
from minivllm.engine.messages import FinishReason
from tests.core.helpers import make_request, make_scheduler, step


def run_to_completion(sched, max_steps=1000):
    finished = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        _, out = step(sched)
        for o in out.outputs:
            if o.finished:
                finished[o.request_id] = o
    return finished


@pytest.mark.usefixtures("mixed_steps")
def test_token_budget_chunks_a_long_prompt_and_mixes_decodes():
    sched = make_scheduler(max_num_batched_tokens=8, enable_prefix_caching=False)
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=5))
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"a": 3}
    sched.add_request(make_request("b", list(range(1, 21)), max_tokens=2))
    so, _ = step(sched)
    # "a" decodes one token, "b" takes the rest of the budget as its first chunk.
    assert so.num_scheduled_tokens == {"a": 1, "b": 7}
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"a": 1, "b": 7}
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"a": 1, "b": 6}


def test_prefill_first_starts_requests_in_a_step_without_decodes():
    sched = make_scheduler(max_num_batched_tokens=8, enable_prefix_caching=False)
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=5))
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"a": 3}
    sched.add_request(make_request("b", [4, 5], max_tokens=3))
    sched.add_request(make_request("c", [6, 7, 8], max_tokens=3))
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"b": 2, "c": 3}  # "a" waits this one step
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"a": 1, "b": 1, "c": 1}


def test_prefill_first_mixes_the_chunks_after_the_first():
    # A started prompt's later chunks share steps with the decodes, and with requests that
    # arrive meanwhile: a long prompt does not hold the decodes back for all its chunks.
    sched = make_scheduler(max_num_batched_tokens=8, enable_prefix_caching=False)
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=8))
    step(sched)
    sched.add_request(make_request("b", list(range(1, 21)), max_tokens=2))
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"b": 8}
    sched.add_request(make_request("c", [4, 5], max_tokens=2))
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"a": 1, "b": 7}
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"a": 1, "b": 5, "c": 2}


def test_prefill_first_runs_the_decodes_when_no_request_can_start():
    # 2 blocks of 4: "a" holds one and fills it; "b" needs both. The step that would have
    # held only "b" runs "a"'s decode instead, until "a" ends and frees its block.
    sched = make_scheduler(num_blocks=2, block_size=4, enable_prefix_caching=False)
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=3))
    step(sched)
    sched.add_request(make_request("b", [4, 5, 6, 7, 8], max_tokens=1))
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"a": 1}
    so, out = step(sched)
    assert so.num_scheduled_tokens == {"a": 1}
    assert out.outputs[0].finished
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"b": 5}


def test_prefill_first_runs_the_decodes_at_max_num_seqs():
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request("a", [1, 2], max_tokens=2))
    sched.add_request(make_request("b", [3, 4], max_tokens=1))
    assert step(sched)[0].num_scheduled_tokens == {"a": 2}
    assert step(sched)[0].num_scheduled_tokens == {"a": 1}
    assert step(sched)[0].num_scheduled_tokens == {"b": 2}


def test_max_num_seqs_limits_running():
    sched = make_scheduler(max_num_seqs=2)
    for i in range(3):
        sched.add_request(make_request(str(i), [1 + i] * 5))
    so, _ = step(sched)
    assert list(so.num_scheduled_tokens) == ["0", "1"]
    assert len(sched.waiting) == 1


def test_every_request_gets_exactly_max_tokens_and_all_blocks_return():
    sched = make_scheduler(num_blocks=32, max_num_batched_tokens=16)
    for i in range(6):
        sched.add_request(make_request(str(i), list(range(1, 4 + 3 * i)), max_tokens=3 + i))
    finished = run_to_completion(sched)
    assert set(finished) == {str(i) for i in range(6)}
    assert all(o.finish_reason == FinishReason.LENGTH for o in finished.values())
    assert sched.kv_cache_manager.get_num_free_blocks() == 32


def test_eos_stops_unless_ignored_and_respects_min_tokens():
    sched = make_scheduler()
    r = make_request("a", [1, 2, 3], max_tokens=10, min_tokens=2)
    r.sampling_params.ignore_eos = False
    sched.add_request(r)
    _, out = step(sched, token=0)  # EOS before min_tokens: keeps going
    assert not out.outputs[0].finished
    _, out = step(sched, token=0)
    assert out.outputs[0].finish_reason == FinishReason.STOP
    assert r.status == RequestStatus.FINISHED_STOPPED


def test_stop_token_ids_set_stop_reason():
    sched = make_scheduler()
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=10, stop_token_ids=[9]))
    _, out = step(sched, token=9)
    assert out.outputs[0].finish_reason == FinishReason.STOP
    assert out.outputs[0].stop_reason == 9


def test_max_model_len_caps_generation():
    sched = make_scheduler(max_model_len=6)
    sched.add_request(make_request("a", [1, 2, 3, 4], max_tokens=100))
    finished = run_to_completion(sched)
    assert finished["a"].finish_reason == FinishReason.LENGTH
    assert sched.kv_cache_manager.get_num_free_blocks() == 64


def test_abort_frees_blocks_in_any_state():
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request("run", [1] * 9, max_tokens=50))
    sched.add_request(make_request("wait", [2] * 9, max_tokens=50))
    step(sched)
    assert sched.kv_cache_manager.get_num_free_blocks() < 64
    sched.finish_requests(["run", "wait"], RequestStatus.FINISHED_ABORTED)
    sched.check_invariants()
    assert sched.kv_cache_manager.get_num_free_blocks() == 64
    assert not sched.has_unfinished_requests()
    so = sched.schedule()
    assert so.finished_req_ids == {"run", "wait"}


@pytest.mark.usefixtures("mixed_steps")
def test_without_chunked_prefill_a_prompt_waits_for_a_step_that_holds_it_whole():
    sched = make_scheduler(
        max_num_batched_tokens=8, enable_prefix_caching=False, enable_chunked_prefill=False
    )
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=5))
    sched.add_request(make_request("b", [4, 5, 6, 7, 8, 9], max_tokens=2))
    so, _ = step(sched)
    # "b" would need a 5-token chunk after "a"'s 3: it waits rather than being cut.
    assert so.num_scheduled_tokens == {"a": 3}
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"a": 1, "b": 6}


def test_engine_args_raise_the_budget_to_max_model_len_without_chunked_prefill():
    from minivllm.engine.arg_utils import EngineArgs
    from minivllm.engine.create_config import create_scheduler_config

    off = EngineArgs(max_num_batched_tokens=512, enable_chunked_prefill=False)
    config = create_scheduler_config(off, max_model_len=2048)
    assert (config.max_num_batched_tokens, config.enable_chunked_prefill) == (2048, False)
    on = EngineArgs(max_num_batched_tokens=512, enable_chunked_prefill=True)
    config = create_scheduler_config(on, max_model_len=2048)
    assert (config.max_num_batched_tokens, config.enable_chunked_prefill) == (512, True)
