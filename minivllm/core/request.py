"""A request as the scheduler sees it: one token list plus counters."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from minivllm.engine.messages import FinishReason

if TYPE_CHECKING:
    from minivllm.core.kv_cache_utils import BlockHash
    from minivllm.engine.messages import EngineCoreRequest
    from minivllm.lora.request import LoRARequest
    from minivllm.pooling_params import PoolingParams
    from minivllm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """The lifecycle; every status after PREEMPTED is a finished one."""

    WAITING = enum.auto()
    WAITING_FOR_FSM = enum.auto()  # waits for its structured-output grammar to compile
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()  # a failure in the step that only this request caused

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> FinishReason | None:
        return _FINISHED_REASONS.get(status)


_FINISHED_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        arrival_time: float = 0.0,
        priority: int = 0,
        cache_salt: str | None = None,
        pooling_params: PoolingParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.pooling_params = pooling_params  # a pooling request: finished by its prompt
        self.lora_request = lora_request
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_prompt_tokens = len(prompt_token_ids)
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        # Async scheduling: tokens scheduled to be sampled whose ids are not back yet.
        self.num_output_placeholders = 0
        # Speculative decoding: the tokens proposed to follow all_token_ids, checked by the
        # next step that schedules this request.
        self.spec_token_ids: list[int] = []
        self.num_cached_tokens = -1  # prefix-cache hit length of the first scheduling
        self.num_preemptions = 0
        # Hashes of the full blocks of all_token_ids, kept up to date by the KV cache manager.
        self.block_hashes: list[BlockHash] = []
        max_tokens = sampling_params.max_tokens
        self.max_tokens = max_tokens if max_tokens is not None else 1 << 62
        # A StructuredOutputRequest when the request has a constraint (set by the scheduler).
        self.structured_output_request = None
        # request_progress.stop_triggers' answer, set by the scheduler when it takes it in.
        self.stop_triggers: tuple[int, frozenset[int]] = (0, frozenset())

    @classmethod
    def from_engine_core_request(cls, request: EngineCoreRequest) -> Request:
        return cls(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params,
            eos_token_id=request.eos_token_id,
            arrival_time=request.arrival_time,
            priority=request.priority,
            cache_salt=request.cache_salt,
            pooling_params=request.pooling_params,
            lora_request=request.lora_request,
        )

    @property
    def lora_int_id(self) -> int:
        """The request's adapter's id; 0 for the base model."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.all_token_ids.extend(token_ids)

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> FinishReason | None:
        return RequestStatus.get_finished_reason(self.status)

    def __lt__(self, other: Request) -> bool:
        # Order for the priority queue: lower priority value first, then earlier arrival.
        return (self.priority, self.arrival_time, self.request_id) < (
            other.priority,
            other.arrival_time,
            other.request_id,
        )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )
