"""A short calibration at start-up for the `slo` policy: synthetic steps of known shapes, so
that its step-time model is fitted before the first request (it keeps learning from every
served step after)."""

from __future__ import annotations

import logging
import random
import time
from typing import TYPE_CHECKING

from minivllm.core.request import Request
from minivllm.core.step_time_model import StepShape, StepTimeModel
from minivllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from minivllm.engine.core import EngineCore

logger = logging.getLogger(__name__)

# (requests at once, prompt tokens, output tokens): prompts of rising length alone, then
# decodes of rising batch size.
_PROMPTS = (16, 128, 512)
_DECODE_BATCHES = (1, 8)
_DECODE_PROMPT, _DECODE_TOKENS = 32, 5


def calibration_plan(max_num_batched_tokens: int, max_model_len: int, max_num_seqs: int):
    """The (requests, prompt tokens, output tokens) groups to run, fitted to the limits."""
    plan = []
    longest = min(max_num_batched_tokens, max_model_len - 2)
    for n in _PROMPTS:
        if n <= longest:
            plan.append((1, n, 1))
    prompt = min(_DECODE_PROMPT, max_model_len - _DECODE_TOKENS - 1)
    for batch in _DECODE_BATCHES:
        if prompt > 0 and batch <= max_num_seqs and batch * prompt <= max_num_batched_tokens:
            plan.append((batch, prompt, _DECODE_TOKENS))
    return plan


def calibrate(core: EngineCore) -> None:
    """Run the plan through the core's own scheduler and executor, then leave no trace of it
    in the KV cache (the requests finish; the prefix cache is reset)."""
    scheduler = core.scheduler
    config = core.config.scheduler_config
    plan = calibration_plan(
        config.max_num_batched_tokens, config.max_model_len, config.max_num_seqs
    )
    vocab = max(min(core.config.model_config.vocab_size, 32000), 2)
    rng = random.Random(0)
    start = time.monotonic()
    count = 0

    def run(batch: int, prompt_len: int, max_tokens: int) -> None:
        nonlocal count
        for _ in range(batch):
            count += 1
            scheduler.add_request(
                Request(
                    f"slo-calibration-{count}",
                    [rng.randrange(1, vocab) for _ in range(prompt_len)],
                    SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0),
                    eos_token_id=None,
                    arrival_time=time.time(),
                )
            )
        while scheduler.has_unfinished_requests() or core.in_flight is not None:
            core.step()

    policy = scheduler.policy
    policy.enabled = False  # whole prompts, whatever the first fits say
    # A first step warms the caches and kernels; its time would mislead the fit.
    run(1, min(_DECODE_PROMPT, config.max_model_len - 3), 2)
    policy.model = StepTimeModel()
    for group in plan:
        run(*group)
    policy.enabled = True
    core.reset_prefix_cache()
    model = scheduler.policy.model
    logger.info(
        "SLO calibration: %d steps in %.1f s; one decode alone %.1f ms, a %d-token prompt "
        "alone %.0f ms",
        model.num_observations,
        time.monotonic() - start,
        1e3 * model.predict(StepShape().with_request(1, 256)),
        config.max_num_batched_tokens,
        1e3 * model.predict(StepShape().with_request(config.max_num_batched_tokens, 0)),
    )
