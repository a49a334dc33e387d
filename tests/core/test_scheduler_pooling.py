"""Pooling requests: finished by their prompt's embedding, never sampled."""

from minivllm.core.request import Request
from minivllm.core.sched_output import ModelRunnerOutput
from minivllm.engine.messages import FinishReason
from minivllm.pooling_params import PoolingParams
from minivllm.sampling_params import SamplingParams
from tests.core.helpers import make_scheduler


def pooling_request(req_id: str, prompt: list[int]) -> Request:
    return Request(
        req_id, prompt, SamplingParams(max_tokens=1), None, pooling_params=PoolingParams()
    )


def pool_finished(so, sched) -> ModelRunnerOutput:
    """What the pooling runner answers: an embedding for each prompt the step completes."""
    req_ids = list(so.num_scheduled_tokens)
    done = {
        r: [float(len(sched.requests[r].prompt_token_ids))]
        for r in req_ids
        if sched.requests[r].num_computed_tokens == sched.requests[r].num_tokens
    }
    return ModelRunnerOutput(req_ids, [[] for _ in req_ids], pooler_output=done)


def test_a_chunked_prompt_finishes_with_its_embedding_and_frees_its_blocks():
    sched = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=8)
    sched.add_request(pooling_request("long", list(range(1, 19))))  # 18 tokens: 3 chunks
    sched.add_request(pooling_request("short", [5, 6, 7]))
    outputs = []
    scheduled = []
    while sched.has_unfinished_requests():
        so = sched.schedule()
        scheduled.append(dict(so.num_scheduled_tokens))
        new = {r.req_id: r.pooling_params for r in so.scheduled_new_reqs}
        assert all(p == PoolingParams() for p in new.values())  # the runner learns the kind
        outputs += sched.update_from_output(so, pool_finished(so, sched)).outputs
        sched.check_invariants()
    assert scheduled == [{"long": 8}, {"long": 8}, {"long": 2, "short": 3}]
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in outputs] == [
        ("long", [], FinishReason.STOP),
        ("short", [], FinishReason.STOP),
    ]
    assert [o.pooling_output for o in outputs] == [[18.0], [3.0]]
    assert not sched.requests
    assert sched.kv_cache_manager.get_num_free_blocks() == 16


def test_a_step_without_its_embedding_leaves_a_pooling_request_running():
    """A chunk that does not end the prompt gives nothing, and nothing is appended."""
    sched = make_scheduler(max_num_batched_tokens=4)
    request = pooling_request("p", list(range(1, 11)))
    sched.add_request(request)
    so = sched.schedule()
    out = sched.update_from_output(so, pool_finished(so, sched))
    assert out.outputs == [] and request.num_tokens == 10
    assert request.num_computed_tokens == 4 and "p" in sched.requests
