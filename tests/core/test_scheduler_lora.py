"""The scheduler with LoRA adapters: no step mixes more than max_loras of them (a request
needing another waits, in its place, while others go by), each adapter's KV blocks are its
own in the prefix cache, and the statistics name the adapters running and waiting."""

from __future__ import annotations

from minivllm.lora.request import LoRARequest
from tests.core.helpers import make_request, make_scheduler, step

A = LoRARequest("a", 1, "/adapters/a")
B = LoRARequest("b", 2, "/adapters/b")


def test_a_step_mixes_at_most_max_loras_adapters():
    sched = make_scheduler(max_loras=1)
    for req_id, lora in [("r1", A), ("r2", B), ("r3", None), ("r4", A)]:
        sched.add_request(make_request(req_id, [1, 2, 3, 4, 5], max_tokens=2, lora_request=lora))
    so, _ = step(sched)
    assert list(so.num_scheduled_tokens) == ["r1", "r3", "r4"]  # r2 waits for a's to end
    assert [new.lora_request for new in so.scheduled_new_reqs] == [A, None, A]
    stats = sched.make_stats()
    assert stats.running_lora_adapters == {"a": 2} and stats.waiting_lora_adapters == {"b": 1}
    while "r2" not in so.num_scheduled_tokens:
        so, _ = step(sched)
    assert all(sched.requests[r].lora_request in (B, None) for r in so.num_scheduled_tokens)
    # Without LoRA (max_loras None) nothing is counted.
    assert make_scheduler().make_stats().running_lora_adapters == {}


def test_prefix_cache_blocks_are_per_adapter():
    sched = make_scheduler(max_loras=2, block_size=4)
    prompt = list(range(1, 14))
    for req_id, lora in [("base", None), ("a", A), ("a-again", A), ("b", B)]:
        request = make_request(req_id, prompt, max_tokens=1, lora_request=lora)
        sched.add_request(request)
        so, _ = step(sched)
        (new,) = so.scheduled_new_reqs
        expected = 12 if req_id == "a-again" else 0  # only the same adapter's blocks hit
        assert new.num_computed_tokens == expected, req_id
