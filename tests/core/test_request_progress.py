"""The scheduler's one-token fast path asks check_stop only where stop_triggers says a stop
may fire: every stop check_stop finds must be among them."""

from __future__ import annotations

import random

from minivllm.core.request import Request, RequestStatus
from minivllm.core.request_progress import check_stop, stop_triggers
from minivllm.sampling_params import SamplingParams


def test_every_stop_check_stop_finds_is_a_trigger():
    rng = random.Random(0)
    stops = 0
    for _ in range(300):
        max_tokens = rng.choice([None, 1, 3, 8])
        params = SamplingParams(
            max_tokens=max_tokens,
            min_tokens=min(rng.choice([0, 2, 5]), max_tokens or 5),
            ignore_eos=rng.random() < 0.3,
            stop_token_ids=rng.sample(range(8), rng.randrange(3)),
        )
        request = Request("r", [1] * rng.randrange(1, 6), params, rng.choice([None, 0, 7]))
        max_model_len = rng.randrange(6, 20)
        length, stop_ids = stop_triggers(request, max_model_len)
        while request.num_tokens < max_model_len:
            token_id = rng.randrange(8)
            request.append_output_token_ids([token_id])
            triggered = request.num_tokens >= length or token_id in stop_ids
            if check_stop(request, token_id, max_model_len):
                assert triggered, (params, request, token_id)
                assert request.status > RequestStatus.PREEMPTED
                stops += 1
                break
    assert stops > 250  # the draws do stop requests, in every way
