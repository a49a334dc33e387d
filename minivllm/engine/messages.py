"""The messages between the frontend and the engine core (msgpack on the wire)."""

from __future__ import annotations

import enum

import msgspec

from minivllm.lora.request import LoRARequest
from minivllm.pooling_params import PoolingParams
from minivllm.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3  # this request alone failed inside the engine (vLLM's "error")

    def __str__(self) -> str:
        return self.name.lower()


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None
    # Set for a pooling request (the pooling runner): its prompt's embedding comes back once
    # the prompt is computed, and nothing is sampled (sampling_params is then a placeholder).
    pooling_params: PoolingParams | None = None
    lora_request: LoRARequest | None = None  # the adapter it runs with (enable_lora)


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # Per new token: (token ids, logprobs, rank of the sampled token), sampled token first.
    new_logprobs: list[tuple[list[int], list[float], int]] | None = None
    # Once, when the prompt is done: (ids [P-1][1+k], logprobs [P-1][1+k], ranks [P-1]).
    new_prompt_logprobs: tuple[list[list[int]], list[list[float]], list[int]] | None = None
    # A pooling request's embedding (float32 values), with its finish.
    pooling_output: list[float] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True):
    """A snapshot of the scheduler after a step; counters are cumulative since start."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # tokens found there
    num_preemptions: int = 0
    # The disk prefix cache (--kv-cache-disk): tokens looked up there after a miss in memory
    # and tokens found (vLLM's external prefix cache counters), blocks read and written.
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    kv_disk_blocks_read: int = 0
    kv_disk_blocks_written: int = 0
    # Speculative decoding: steps that checked proposals, tokens proposed, tokens accepted.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    # With LoRA on: adapter name -> requests running (waiting) under it.
    running_lora_adapters: dict[str, int] = {}
    waiting_lora_adapters: dict[str, int] = {}
    # The slo policy's step-time coefficients as last refitted (empty under other policies):
    # the frontend's admission check follows them, not only the start-up calibration.
    slo_step_time_model: list[float] = []


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    # Which engine core sent them (data parallelism; set by the frontend's client).
    engine_index: int = 0


# ----------------------------------------------------------------- the wire protocol
# Every ZeroMQ message is two frames: one type byte, then a msgpack payload.


class EngineCoreRequestType(bytes, enum.Enum):
    """Frontend -> engine core."""

    ADD = b"\x00"  # payload: EngineCoreRequest
    ABORT = b"\x01"  # payload: list of request ids
    UTILITY = b"\x02"  # payload: UtilityRequest
    SHUTDOWN = b"\x03"  # payload: empty; leave the busy loop and exit


class EngineCoreOutputType(bytes, enum.Enum):
    """Engine core -> frontend."""

    OUTPUTS = b"\x00"  # payload: EngineCoreOutputs, one per step
    UTILITY = b"\x01"  # payload: UtilityResult
    READY = b"\x02"  # payload: EngineCoreReady; the start-up handshake succeeded
    DEAD = b"\x03"  # payload: EngineCoreError; the core failed and is exiting


class UtilityRequest(msgspec.Struct, array_like=True):
    """Call a method of EngineCore by name (stats, cache resets): answered out of band."""

    call_id: int
    method: str
    args: list = []


class UtilityResult(msgspec.Struct, array_like=True):
    call_id: int
    result: msgspec.Raw = msgspec.Raw(b"\xc0")  # msgpack; the caller knows its type
    error: str | None = None


class EngineCoreReady(msgspec.Struct, array_like=True):
    pid: int
    num_blocks: int
    weight_memory_bytes: int = 0  # the model's weights, all ranks together
    # The slo policy's step-time model as calibrated (empty under other policies): the
    # frontend refuses latency-sensitive requests it says cannot meet their targets.
    step_time_model: list[float] = []


class EngineCoreError(msgspec.Struct, array_like=True, omit_defaults=True):
    """Why the core failed: at start-up (the frontend re-raises it) or while running."""

    during_startup: bool
    exc_type: str  # qualified name, for the message when the exception cannot be rebuilt
    message: str
    traceback: str
    pickled: bytes | None = None  # the exception itself, when it pickles
