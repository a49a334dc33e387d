"""A step's sampled tokens into the scheduler's requests, and the step's EngineCoreOutputs:
each request's tokens appended up to a stop, speculative decoding's accepted proposals
counted, finished requests freed, one output per request (``Scheduler.update_from_output``).

This is per-request Python on every step (256 requests a step on a GPU): the usual request,
one token and no grammar, takes a short path that appends its token and asks the stop
checks only where ``stop_triggers`` says one may fire.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from minivllm.core.request import Request, RequestStatus
from minivllm.core.request_progress import append_tokens, check_stop
from minivllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from minivllm.engine.messages import EngineCoreOutput, EngineCoreOutputs, FinishReason

if TYPE_CHECKING:
    from minivllm.core.scheduler import Scheduler

logger = logging.getLogger(__name__)


def update_from_output(
    scheduler: Scheduler, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
) -> EngineCoreOutputs:
    """Append sampled tokens, check the stop conditions, and free finished requests."""
    outputs: list[EngineCoreOutput] = []
    logprobs = runner_output.logprobs
    prompt_logprobs = runner_output.prompt_logprobs
    spec_token_ids = runner_output.spec_token_ids
    all_drafts = scheduler_output.scheduled_spec_decode_tokens
    requests = scheduler.requests
    max_model_len = scheduler.max_model_len
    if scheduler.in_flight is not None:
        scheduler.in_flight.difference_update(scheduler_output.num_scheduled_tokens)
    if hasattr(scheduler_output.grammar_bitmask, "result"):
        scheduler_output.grammar_bitmask.result()  # its rows' failures are known once filled
    for i, (req_id, token_ids) in enumerate(
        zip(runner_output.req_ids, runner_output.sampled_token_ids)
    ):
        request = requests.get(req_id)
        if request is None or request.status != RequestStatus.RUNNING:
            continue  # aborted or preempted since it was scheduled
        if request.pooling_params is not None:
            pooled = runner_output.pooler_output.get(req_id)
            if pooled is not None:  # its prompt is done: the embedding is its output
                outputs.append(_finish_pooling(scheduler, request, pooled))
            continue
        if not token_ids:
            continue  # a prefill chunk that has not reached the end of the prompt
        if request.num_output_placeholders:
            request.num_output_placeholders -= len(token_ids)
        drafts = all_drafts.get(req_id) if all_drafts else None
        if drafts:
            # The proposals after the first one the model disagreed with computed K/V
            # for the wrong tokens: they count as not computed, to be written over.
            accepted = len(token_ids) - 1
            request.num_computed_tokens -= len(drafts) - accepted
            scheduler.num_drafts += 1
            scheduler.num_draft_tokens += len(drafts)
            scheduler.num_accepted_tokens += accepted
        try:
            if len(token_ids) == 1 and request.structured_output_request is None:
                # The usual token: appended, and the stop checks only where one may fire.
                token_id = token_ids[0]
                all_token_ids = request.all_token_ids
                all_token_ids.append(token_id)
                length, stop_ids = request.stop_triggers
                stopped = False
                if len(all_token_ids) >= length or token_id in stop_ids:
                    stopped = check_stop(request, token_id, max_model_len)
                new_ids = token_ids
            else:
                new_ids = append_tokens(
                    request, token_ids, max_model_len, scheduler.structured_output_manager
                )
                stopped = request.is_finished()
        except Exception:
            # Caused by this request alone (its grammar, its stop checks): it fails, and
            # the batch goes on. Failures of the whole step raise before this loop.
            logger.exception("Request %s failed in its step; it alone ends", req_id)
            scheduler.running.remove(request)
            outputs.append(scheduler._finish_with_error(request))
            continue
        if stopped:
            scheduler.running.remove(request)
            scheduler._free_request(request)
        elif spec_token_ids:
            request.spec_token_ids = spec_token_ids.get(req_id, [])
        outputs.append(
            EngineCoreOutput(
                req_id,
                new_ids,
                request.get_finished_reason() if stopped else None,
                request.stop_reason,
                request.num_cached_tokens if request.num_cached_tokens > 0 else 0,
                [logprobs[i]] if logprobs and logprobs[i] else None,
                prompt_logprobs.get(req_id) if prompt_logprobs else None,
            )
        )
    if scheduler._pending_outputs:
        outputs += scheduler._pending_outputs
        scheduler._pending_outputs = []
    return EngineCoreOutputs(
        outputs=outputs, scheduler_stats=scheduler.make_stats(), timestamp=time.monotonic()
    )


def _finish_pooling(
    scheduler: Scheduler, request: Request, pooled: list[float]
) -> EngineCoreOutput:
    """A pooling request whose prompt is done: its embedding is its one output."""
    request.status = RequestStatus.FINISHED_STOPPED
    scheduler.running.remove(request)
    scheduler._free_request(request)
    return EngineCoreOutput(
        request_id=request.request_id,
        new_token_ids=[],
        finish_reason=FinishReason.STOP,
        num_cached_tokens=max(request.num_cached_tokens, 0),
        pooling_output=pooled,
    )
