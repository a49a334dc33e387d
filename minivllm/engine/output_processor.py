"""Turns EngineCoreOutputs into RequestOutputs: text, stop strings, output kinds."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from minivllm.engine.detokenizer import IncrementalDetokenizer
from minivllm.engine.messages import EngineCoreOutput, FinishReason
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    output_token_ids: list[int] = field(default_factory=list)
    sent_text_offset: int = 0
    sent_token_offset: int = 0
    queue: asyncio.Queue | None = None  # AsyncLLM: where this request's outputs go


@dataclass
class OutputProcessorOutput:
    request_outputs: list[RequestOutput]
    # Finished here (a stop string) but not yet in the engine core: abort them there.
    reqs_to_abort: list[str]


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        queue: asyncio.Queue | None = None,
    ) -> None:
        if request_id in self.request_states:
            raise ValueError(f"Request id {request_id} is already running.")
        detokenizer = (
            IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params)
            if params.detokenize and self.tokenizer is not None
            else None
        )
        self.request_states[request_id] = RequestState(
            request_id, prompt, prompt_token_ids, params, detokenizer, queue=queue
        )

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forget requests; returns those that were known."""
        return [r for r in request_ids if self.request_states.pop(r, None) is not None]

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def get_num_unfinished_requests(self) -> int:
        return len(self.request_states)

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> OutputProcessorOutput:
        request_outputs, reqs_to_abort = [], []
        for out in outputs:
            state = self.request_states.get(out.request_id)
            if state is None:
                continue  # aborted while the step ran
            state.output_token_ids.extend(out.new_token_ids)
            finish_reason, stop_reason = out.finish_reason, out.stop_reason
            if state.detokenizer is not None:
                stop = state.detokenizer.update(out.new_token_ids, len(state.output_token_ids))
                if stop is not None:
                    if finish_reason is None:
                        reqs_to_abort.append(out.request_id)
                    finish_reason, stop_reason = FinishReason.STOP, stop
            request_output = self._make_request_output(state, finish_reason, stop_reason, out)
            if finish_reason is not None:
                del self.request_states[out.request_id]
            if request_output is None:
                continue
            if state.queue is not None:
                state.queue.put_nowait(request_output)
            else:
                request_outputs.append(request_output)
        return OutputProcessorOutput(request_outputs, reqs_to_abort)

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
            finish_reason=str(finish_reason) if finished else None,
            stop_reason=stop_reason,
        )
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=None,
            outputs=[completion],
            finished=finished,
            num_cached_tokens=out.num_cached_tokens,
        )
