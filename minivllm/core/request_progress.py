"""A request's progress by one step: the proposed tokens the step computes, then the sampled
tokens appended up to the first stop (length, EOS, a stop token id, or a grammar that is
complete), its grammar advanced token by token. The scheduler calls these for every running
request; stop strings are the detokenizer's, in the frontend."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from minivllm.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from minivllm.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


def append_tokens(
    request: Request,
    token_ids: list[int],
    max_model_len: int,
    structured_output_manager: StructuredOutputManager | None,
) -> list[int]:
    """Append sampled tokens up to a stop; advance the grammar. Returns those appended."""
    so_request = request.structured_output_request
    if so_request is not None and so_request.failure is not None:
        raise so_request.failure  # its bitmask row failed: the token was drawn unconstrained
    new_ids = []
    for token_id in token_ids:
        request.append_output_token_ids([token_id])
        new_ids.append(token_id)
        if so_request is not None:
            _advance_grammar(request, token_id)
            if _grammar_ends_before_min_tokens(request, structured_output_manager):
                request.status = RequestStatus.FINISHED_STOPPED
                break
        if check_stop(request, token_id, max_model_len):
            break
    return new_ids


def fit_drafts(request: Request, num_new: int, budget: int, max_model_len: int) -> list[int]:
    """The request's proposed tokens that this step computes (taken off the request): after
    its num_new known ones, within the budget, and no more than could be kept before
    max_tokens or max_model_len ends it."""
    drafts, request.spec_token_ids = request.spec_token_ids, []
    if not drafts:
        return drafts
    room = min(
        budget - num_new,
        request.max_tokens - request.num_output_tokens - 1,
        max_model_len - request.num_tokens,
    )
    return drafts[: max(room, 0)]


def stop_triggers(request: Request, max_model_len: int) -> tuple[int, frozenset[int]]:
    """(the length at which the request ends, the tokens that may end it): a token outside
    the set, appended below that length, cannot end it, so ``check_stop`` need not look
    (the scheduler's one-token fast path)."""
    params = request.sampling_params
    stop_ids = set(params.stop_token_ids or ())
    if not params.ignore_eos and request.eos_token_id is not None:
        stop_ids.add(request.eos_token_id)
    length = min(max_model_len, request.num_prompt_tokens + request.max_tokens)
    return length, frozenset(stop_ids)


def check_stop(request: Request, token_id: int, max_model_len: int) -> bool:
    """Whether the token just appended ends the request (its status says how)."""
    params = request.sampling_params
    if request.num_tokens >= max_model_len or request.num_output_tokens >= request.max_tokens:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    if request.num_output_tokens < params.min_tokens:
        return False
    if not params.ignore_eos and token_id == request.eos_token_id:
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    if token_id in params.stop_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = token_id
        return True
    return False


def _grammar_ends_before_min_tokens(
    request: Request, structured_output_manager: StructuredOutputManager
) -> bool:
    """Under min_tokens the stop tokens are banned; once the grammar is complete and takes
    only a stop token, nothing would be left to sample (every logit -inf, and the sampler
    drew token 0 outside the grammar). The grammar wins: the output ends there."""
    params = request.sampling_params
    return (
        request.num_output_tokens < params.min_tokens
        and not params.ignore_eos
        and structured_output_manager.only_stop_allowed(request.structured_output_request)
    )


def _advance_grammar(request: Request, token_id: int) -> None:
    so_request = request.structured_output_request
    if not so_request.accept(token_id):
        logger.warning(
            "Request %s: token %d does not match its grammar", request.request_id, token_id
        )
    if not so_request.reasoning_ended:
        n = len(so_request.reasoning_end_ids)
        if n and request.num_output_tokens >= n:
            so_request.see_output(request.all_token_ids[-n:])
