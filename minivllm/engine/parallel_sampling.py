"""n > 1: one user request becomes n independent requests in the engine core.

The core only ever sees n = 1. The frontend sends child requests named
``"{index}_{request_id}"`` and folds their outputs back into one RequestOutput whose
completions carry their index, as vLLM V1 does.
"""

from __future__ import annotations

import msgspec

from minivllm.engine.messages import EngineCoreRequest
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.sampling_params import RequestOutputKind, SamplingParams


class ParentRequest:
    def __init__(self, request_id: str, params: SamplingParams) -> None:
        self.request_id = request_id
        self.params = params
        self.child_ids = [f"{i}_{request_id}" for i in range(params.n)]
        self._completions: list[CompletionOutput | None] = [None] * params.n
        self._num_finished = 0

    def child_params(self, index: int) -> SamplingParams:
        seed = self.params.seed
        return msgspec.structs.replace(
            self.params, n=1, seed=None if seed is None else seed + index
        )

    def make_output(self, index: int, child: RequestOutput) -> RequestOutput | None:
        """Fold one child's output in; return what the user sees now, if anything."""
        completion = child.outputs[0]
        completion.index = index
        if child.finished:
            self._num_finished += 1
        finished = self._num_finished == len(self._completions)
        kind = self.params.output_kind
        if kind == RequestOutputKind.DELTA:
            completions = [completion]
        else:
            self._completions[index] = completion
            if kind == RequestOutputKind.FINAL_ONLY and not finished:
                return None
            completions = [c for c in self._completions if c is not None]
        return RequestOutput(
            request_id=self.request_id,
            prompt=child.prompt,
            prompt_token_ids=child.prompt_token_ids,
            prompt_logprobs=child.prompt_logprobs,
            outputs=completions,
            finished=finished,
            num_cached_tokens=child.num_cached_tokens,
        )

    @property
    def finished(self) -> bool:
        return self._num_finished == len(self._completions)


def fan_out(request: EngineCoreRequest) -> tuple[ParentRequest | None, list[EngineCoreRequest]]:
    """The requests to send to the core for one user request (itself when n = 1)."""
    params = request.sampling_params
    if params.n == 1:
        return None, [request]
    parent = ParentRequest(request.request_id, params)
    children = [
        msgspec.structs.replace(
            request, request_id=child_id, sampling_params=parent.child_params(i)
        )
        for i, child_id in enumerate(parent.child_ids)
    ]
    return parent, children
