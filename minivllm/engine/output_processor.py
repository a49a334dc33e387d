"""Turns EngineCoreOutputs into RequestOutputs: text, stop strings, output kinds."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

from minivllm.engine.detokenizer import IncrementalDetokenizer
from minivllm.engine.messages import EngineCoreOutput, FinishReason
from minivllm.engine.parallel_sampling import ParentRequest
from minivllm.logprobs import PositionLogprobs, make_position_logprobs
from minivllm.metrics.stats import IterationStats, RequestStateStats
from minivllm.outputs import (
    CompletionOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
)
from minivllm.pooling_params import PoolingParams
from minivllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams | PoolingParams
    detokenizer: IncrementalDetokenizer | None
    output_token_ids: list[int] = field(default_factory=list)
    sent_text_offset: int = 0
    sent_token_offset: int = 0
    queue: asyncio.Queue | None = None  # AsyncLLM: where this request's outputs go
    parent: ParentRequest | None = None  # n > 1: the user's request this one is part of
    child_index: int = 0
    logprobs: list[PositionLogprobs] | None = None  # per output token, when asked
    cumulative_logprob: float | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    stats: RequestStateStats | None = None  # while a stat logger records
    finish_reason: FinishReason | None = None  # once it ended


class StatLogger(Protocol):
    """Where request statistics go (metrics.loggers.StatLoggerManager)."""

    def record(self, *, iteration: IterationStats) -> None: ...


@dataclass
class OutputProcessorOutput:
    request_outputs: list[RequestOutput]
    # Finished here (a stop string) but not yet in the engine core: abort them there.
    reqs_to_abort: list[str]


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState] = {}
        self.parent_requests: dict[str, ParentRequest] = {}
        self._token_text: dict[int, str] = {}  # decoded single tokens, for logprobs
        # Each request's statistics (tokens, time to first token, inter-token latencies, how
        # it ended) go here as its outputs arrive, when set (record_stats: the server's).
        self.stat_logger: StatLogger | None = None
        self.slo_defaults: tuple[float | None, float | None] = (None, None)  # (TPOT, TTFT)

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams | PoolingParams,
        queue: asyncio.Queue | None = None,
        parent: ParentRequest | None = None,
    ) -> None:
        """params: a pooling request's PoolingParams (nothing to detokenize), else its
        SamplingParams."""
        if request_id in self.request_states:
            raise ValueError(f"Request id {request_id} is already running.")
        child_index = 0
        if parent is not None:
            self.parent_requests[parent.request_id] = parent
            child_index = parent.child_ids.index(request_id)
        detokenizer = (
            IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params)
            if isinstance(params, SamplingParams)
            and params.detokenize
            and self.tokenizer is not None
            else None
        )
        stats = None
        if self.stat_logger is not None:
            # One sequence per core request; n and max_tokens are the user's request's.
            n = parent.params.n if parent is not None else 1
            sampling = isinstance(params, SamplingParams)
            slo = params.slo_params if sampling else None
            if slo is not None:  # the targets the SLO metrics judge by: the engine's defaults in
                slo = slo.with_defaults(*self.slo_defaults)
            max_tokens = params.max_tokens if sampling else None
            stats = RequestStateStats(len(prompt_token_ids), n, max_tokens, slo=slo)
        self.request_states[request_id] = RequestState(
            request_id,
            prompt,
            prompt_token_ids,
            params,
            detokenizer,
            queue=queue,
            parent=parent,
            child_index=child_index,
            stats=stats,
        )

    def record_stats(
        self, stat_logger: StatLogger, slo_defaults: tuple[float | None, float | None]
    ) -> None:
        """Record each request's statistics into stat_logger from now on; slo_defaults: the
        engine's (TPOT, TTFT) targets for requests that set none."""
        self.stat_logger = stat_logger
        self.slo_defaults = slo_defaults

    def is_active(self, request_id: str) -> bool:
        """Whether a user request of this id is running (n > 1 requests count once)."""
        return request_id in self.request_states or request_id in self.parent_requests

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forget requests (a parent: all its children); returns the engine core's ids.

        A request with a queue (AsyncLLM) gets a last output, finish_reason "abort", so
        that a stream waiting on it ends.
        """
        core_ids = []
        iteration = IterationStats()
        for request_id in request_ids:
            parent = self.parent_requests.pop(request_id, None)
            for core_id in parent.child_ids if parent is not None else [request_id]:
                state = self.request_states.pop(core_id, None)
                if state is None:
                    continue
                core_ids.append(core_id)
                if state.stats is not None:
                    state.stats.finish(0, "abort", iteration, time.monotonic())
                if state.queue is not None:
                    self._end_stream(state)
        self._record(iteration)
        return core_ids

    def _record(self, iteration: IterationStats) -> None:
        if self.stat_logger is not None and (
            iteration.num_generation_tokens
            or iteration.num_prompt_tokens
            or iteration.finished_requests
        ):
            self.stat_logger.record(iteration=iteration)

    def _end_stream(self, state: RequestState) -> None:
        aborted = EngineCoreOutput(state.request_id, [], finish_reason=FinishReason.ABORT)
        if isinstance(state.params, PoolingParams):
            state.queue.put_nowait(_pooling_output(state, aborted, FinishReason.ABORT))
            return
        output = self._make_request_output(state, FinishReason.ABORT, None, aborted)
        if output is not None and state.parent is not None:
            output = state.parent.make_output(state.child_index, output)
        if output is not None and output.finished:
            state.queue.put_nowait(output)

    def propagate_error(self, error: BaseException) -> None:
        """AsyncLLM: wake every waiting stream with the error (the engine died)."""
        for state in self.request_states.values():
            if state.queue is not None:
                state.queue.put_nowait(error)

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def get_num_unfinished_requests(self) -> int:
        singles = sum(1 for state in self.request_states.values() if state.parent is None)
        return singles + len(self.parent_requests)

    def process_outputs(
        self, outputs: list[EngineCoreOutput], engine_index: int = 0
    ) -> OutputProcessorOutput:
        """engine_index: the engine core that sent them (data parallelism), for the
        metrics' ``engine`` label."""
        request_outputs, reqs_to_abort = [], []
        iteration, now = IterationStats(engine_index=engine_index), time.monotonic()
        for out in outputs:
            state = self.request_states.get(out.request_id)
            if state is None:
                continue  # aborted while the step ran
            num_tokens_before = len(state.output_token_ids) if state.stats is not None else 0
            try:
                request_output = self._process_output(state, out, reqs_to_abort)
            except Exception:
                # Its text or logprobs could not be made: it fails alone (finish_reason
                # "error"), and is aborted in the engine core if it still runs there.
                logger.exception("Request %s: processing its output failed", out.request_id)
                if not out.finished:
                    reqs_to_abort.append(out.request_id)
                request_output = self._error_output(state, out)
            if state.stats is not None:
                self._update_stats(state, out, num_tokens_before, iteration, now)
            if request_output is None:
                continue
            if state.queue is not None:
                state.queue.put_nowait(request_output)
            else:
                request_outputs.append(request_output)
        self._record(iteration)
        return OutputProcessorOutput(request_outputs, reqs_to_abort)

    def _update_stats(
        self,
        state: RequestState,
        out: EngineCoreOutput,
        num_tokens_before: int,
        iteration: IterationStats,
        now: float,
    ) -> None:
        """A request's step in the statistics: its new tokens (those it keeps: a stop string
        trims its own), and its end, if it ended (a pooling request counts its prompt then)."""
        stats = state.stats
        if isinstance(state.params, PoolingParams):
            if out.finished:
                if out.finish_reason == FinishReason.STOP:
                    iteration.num_prompt_tokens += stats.num_prompt_tokens
                stats.finish(0, str(out.finish_reason), iteration, now)
            return
        stats.add_tokens(0, max(0, len(state.output_token_ids) - num_tokens_before), iteration, now)
        if state.finish_reason is not None:
            stats.finish(0, str(state.finish_reason), iteration, now)

    def _process_output(
        self, state: RequestState, out: EngineCoreOutput, reqs_to_abort: list[str]
    ) -> RequestOutput | None:
        """One request's new tokens: text, stop strings, logprobs; its output, if one is due."""
        if isinstance(state.params, PoolingParams):  # its one output: the embedding
            if out.finish_reason == FinishReason.ERROR:
                return self._error_output(state, out)
            if out.finished:
                del self.request_states[out.request_id]
                return _pooling_output(state, out, out.finish_reason)
            return None
        if out.finish_reason == FinishReason.ERROR:
            return self._error_output(state, out)
        state.output_token_ids.extend(out.new_token_ids)
        if out.new_logprobs or out.new_prompt_logprobs is not None:
            self._add_logprobs(state, out)
        finish_reason, stop_reason = out.finish_reason, out.stop_reason
        if state.detokenizer is not None:
            stop = state.detokenizer.update(out.new_token_ids, len(state.output_token_ids))
            if stop is not None:
                if state.detokenizer.num_unread:  # the output ends at the stop string's token
                    del state.output_token_ids[-state.detokenizer.num_unread :]
                if finish_reason is None:
                    reqs_to_abort.append(out.request_id)
                finish_reason, stop_reason = FinishReason.STOP, stop
        if finish_reason is None and state.params.output_kind == RequestOutputKind.FINAL_ONLY:
            return None  # LLM.generate's: nothing to send before the end
        request_output = self._make_request_output(state, finish_reason, stop_reason, out)
        if finish_reason is not None:
            state.finish_reason = finish_reason
            del self.request_states[out.request_id]
        return self._to_parent(state, request_output)

    def _to_parent(self, state: RequestState, output: RequestOutput | None) -> RequestOutput | None:
        """n > 1: fold a child's output into its parent's (what the user sees now)."""
        if output is None or state.parent is None:
            return output
        parent = state.parent
        output = parent.make_output(state.child_index, output)
        if parent.finished:
            self.parent_requests.pop(parent.request_id, None)
        return output

    def _error_output(self, state: RequestState, out: EngineCoreOutput) -> RequestOutput | None:
        """The last output of a request that failed alone: finish_reason "error", no new text."""
        self.request_states.pop(state.request_id, None)
        state.finish_reason = FinishReason.ERROR
        if isinstance(state.params, PoolingParams):
            return _pooling_output(state, out, FinishReason.ERROR)
        completion = CompletionOutput(
            index=0, text="", token_ids=[], finish_reason=str(FinishReason.ERROR)
        )
        output = RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=None,
            outputs=[completion],
            finished=True,
            num_cached_tokens=out.num_cached_tokens,
        )
        return self._to_parent(state, output)

    def _decode_token(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    def _add_logprobs(self, state: RequestState, out: EngineCoreOutput) -> None:
        if out.new_logprobs:
            if state.logprobs is None:
                state.logprobs, state.cumulative_logprob = [], 0.0
            for token_ids, values, rank in out.new_logprobs:
                state.logprobs.append(
                    make_position_logprobs(token_ids, values, rank, self._decode_token)
                )
                state.cumulative_logprob += values[0]
        if out.new_prompt_logprobs is not None and state.prompt_logprobs is None:
            ids, values, ranks = out.new_prompt_logprobs
            state.prompt_logprobs = [None] + [  # the first prompt token has no context
                make_position_logprobs(i, v, r, self._decode_token)
                for i, v, r in zip(ids, values, ranks)
            ]

    def _make_request_output(
        self, state: RequestState, finish_reason, stop_reason, out: EngineCoreOutput
    ) -> RequestOutput | None:
        finished = finish_reason is not None
        kind = state.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind == RequestOutputKind.DELTA
        text_offset = state.sent_text_offset if delta else 0
        token_offset = state.sent_token_offset if delta else 0
        text = state.detokenizer.get_text(finished, text_offset) if state.detokenizer else ""
        token_ids = state.output_token_ids[token_offset:]
        if delta:
            if not text and not token_ids and not finished:
                return None
            state.sent_text_offset += len(text)
            state.sent_token_offset = len(state.output_token_ids)
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=state.cumulative_logprob,
            logprobs=state.logprobs[token_offset:] if state.logprobs is not None else None,
            finish_reason=str(finish_reason) if finished else None,
            stop_reason=stop_reason,
        )
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=state.prompt_logprobs,
            outputs=[completion],
            finished=finished,
            num_cached_tokens=out.num_cached_tokens,
        )


def _pooling_output(
    state: RequestState, out: EngineCoreOutput, finish_reason: FinishReason
) -> PoolingRequestOutput:
    """A pooling request's one output: its embedding, or an empty one when it ended
    otherwise ("abort", "error")."""
    import torch  # here: a generating frontend never needs it

    values = out.pooling_output if finish_reason == FinishReason.STOP else None
    return PoolingRequestOutput(
        request_id=state.request_id,
        outputs=PoolingOutput(torch.tensor(values or [], dtype=torch.float32)),
        prompt_token_ids=state.prompt_token_ids,
        finished=True,
        num_cached_tokens=out.num_cached_tokens,
        prompt=state.prompt,
        finish_reason=str(finish_reason),
    )
