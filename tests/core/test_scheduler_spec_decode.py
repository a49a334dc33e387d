"""The scheduler with speculative decoding: a request's proposals are scheduled after its
last token, within the budget, max_tokens and max_model_len; the K/V of rejected ones
counts as not computed; preemption drops them; the counters add up."""

from __future__ import annotations

from minivllm.core.sched_output import ModelRunnerOutput
from tests.core.helpers import make_request, make_scheduler, step


def decoding(sched, req_id="r", prompt=(1, 2, 3, 4, 5), max_tokens=20):
    """A request past its prompt (one token sampled), with no proposals yet."""
    sched.add_request(make_request(req_id, list(prompt), max_tokens=max_tokens))
    step(sched)
    return sched.requests[req_id]


def run(sched, sampled: dict, proposals: dict):
    so = sched.schedule()
    out = ModelRunnerOutput(
        list(so.num_scheduled_tokens), [sampled.get(r, []) for r in so.num_scheduled_tokens]
    )
    out.spec_token_ids = proposals
    sched.update_from_output(so, out)
    sched.check_invariants()
    return so


def test_proposals_are_scheduled_and_rejected_ones_uncomputed():
    sched = make_scheduler()
    request = decoding(sched)
    assert request.num_computed_tokens == 5 and request.num_tokens == 6
    so = run(sched, {"r": [8]}, {"r": [9, 10, 11]})  # a plain step that proposes three
    assert so.scheduled_spec_decode_tokens == {}
    assert request.spec_token_ids == [9, 10, 11]
    so = run(sched, {"r": [9, 12]}, {"r": [13]})  # 9 accepted, 10 rejected (12 instead)
    assert so.num_scheduled_tokens == {"r": 4}
    assert so.scheduled_spec_decode_tokens == {"r": [9, 10, 11]}
    assert request.output_token_ids == [7, 8, 9, 12]
    # Positions 6 (8) and 7 (9) were computed with the right tokens; 8 and 9 were not.
    assert request.num_computed_tokens == 8 == request.num_tokens - 1
    assert request.spec_token_ids == [13]
    stats = sched.make_stats()
    assert (
        stats.spec_decode_num_drafts,
        stats.spec_decode_num_draft_tokens,
        stats.spec_decode_num_accepted_tokens,
    ) == (1, 3, 1)


def test_proposals_fit_max_tokens_max_model_len_and_the_budget():
    sched = make_scheduler()
    request = decoding(sched, max_tokens=4)  # 1 output so far: at most 3 more, so 2 proposed
    run(sched, {"r": [8]}, {"r": [1, 2, 3, 4]})
    so = run(sched, {"r": [1, 2]}, {})
    assert so.scheduled_spec_decode_tokens == {"r": [1]}  # 2 outputs: 2 more, so 1 proposed
    assert request.is_finished() and request.output_token_ids == [7, 8, 1, 2]

    sched = make_scheduler(max_model_len=9)
    request = decoding(sched)  # 6 tokens; positions up to 8 may be computed
    run(sched, {"r": [8]}, {"r": [1, 2, 3, 4]})  # 7 tokens: positions 6, 7, 8 this step
    so = run(sched, {"r": [1, 2, 3]}, {})
    assert so.scheduled_spec_decode_tokens == {"r": [1, 2]}
    assert request.num_tokens == 9 and request.is_finished()

    sched = make_scheduler(max_num_batched_tokens=6)
    for req_id in ("a", "b"):
        decoding(sched, req_id)
    run(sched, {"a": [8], "b": [8]}, {"a": [1, 2, 3, 4], "b": [1, 2, 3, 4]})
    so = run(sched, {"a": [1], "b": [1]}, {})
    assert so.num_scheduled_tokens == {"a": 5, "b": 1}  # b's proposals found no budget
    assert so.scheduled_spec_decode_tokens == {"a": [1, 2, 3, 4]}


def test_preemption_drops_proposals():
    sched = make_scheduler(num_blocks=4, block_size=4, enable_prefix_caching=False)
    request = decoding(sched, "r", prompt=(1, 2, 3))
    run(sched, {"r": [8]}, {"r": [1, 2, 3, 4]})
    sched._preempt(sched.running.pop())
    assert request.spec_token_ids == [] and request.num_computed_tokens == 0
    so = run(sched, {"r": [5]}, {})
    assert so.scheduled_spec_decode_tokens == {}
    assert so.num_scheduled_tokens == {"r": 5}  # the prompt and outputs again, no proposals
