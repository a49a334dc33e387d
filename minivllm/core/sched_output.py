"""What the scheduler tells the model runner each step: new requests once, then diffs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from minivllm.kv_offload.disk_tier import KVTransfers
from minivllm.lora.request import LoRARequest
from minivllm.pooling_params import PoolingParams
from minivllm.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen (or must rebuild after preemption)."""

    req_id: str
    token_ids: list[int]  # prompt and any output so far (a resumed request has some)
    num_prompt_tokens: int
    sampling_params: SamplingParams
    eos_token_id: int | None
    block_ids: list[int]
    num_computed_tokens: int
    pooling_params: PoolingParams | None = None  # a pooling request (nothing is sampled)
    lora_request: LoRARequest | None = None  # its adapter (None: the base model)
    # A hybrid model's: the state cache slot the request holds while it runs (a resumed
    # request may get another; its state starts from zero either way).
    state_slot: int | None = None


@dataclass
class CachedRequestData:
    """Diffs for requests the runner already holds, in parallel lists."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    # Pipeline parallelism only (empty otherwise; vLLM's): the tokens each request computes
    # this step, from its num_computed_tokens on, so that the stages that do not sample
    # learn the tokens sampled since its last step (engine/batch_queue.py fills it).
    new_token_ids: list[list[int]] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # req_id -> number of tokens to compute this step, in batch order.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests the runner should forget: finished, aborted or preempted since the last step.
    finished_req_ids: set[str]
    preempted_req_ids: set[str] = field(default_factory=set)
    # Structured outputs: req_id -> its row in grammar_bitmask, for requests that sample
    # this step under a grammar. grammar_bitmask is a [rows, ceil(V / 32)] int32 tensor,
    # or (in process) a Future of it, still being filled while the forward pass runs.
    structured_output_request_ids: dict[str, int] = field(default_factory=dict)
    grammar_bitmask: Any = None
    # Speculative decoding: req_id -> the proposed tokens this step computes after the
    # request's last token (counted in its num_scheduled_tokens).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # The disk prefix cache (--kv-cache-disk): blocks the workers fill from disk before
    # this step and write to disk after it (kv_offload/disk_tier.py).
    kv_transfers: KVTransfers | None = None


@dataclass
class ModelRunnerOutput:
    """Sampled tokens per scheduled request (empty for a prefill chunk that does not sample;
    with speculative decoding, the accepted proposals and the token after them)."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    # Per request (parallel to req_ids), when any asked: (token ids, logprobs, rank of the
    # sampled token) with the sampled token first, then the top-k.
    logprobs: list[tuple[list[int], list[float], int] | None] | None = None
    # req_id -> (ids [P-1][1+k], logprobs [P-1][1+k], ranks [P-1]) once its prompt is done.
    prompt_logprobs: dict[str, tuple] = field(default_factory=dict)
    # req_id -> its embedding, for each pooling request whose prompt this step finished.
    pooler_output: dict[str, list[float]] = field(default_factory=dict)
    # Speculative decoding: req_id -> the tokens proposed to follow its sampled ones.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)


class AsyncModelRunnerOutput:
    """A step launched on the device whose sampled ids are still on their way to the host
    (async scheduling): ``get_output`` waits for them alone, not for steps launched since."""

    def __init__(self, collect) -> None:
        self._collect = collect  # () -> ModelRunnerOutput, called once
        self._output: ModelRunnerOutput | None = None

    @classmethod
    def ready(cls, output: ModelRunnerOutput) -> AsyncModelRunnerOutput:
        return cls(lambda: output)

    def get_output(self) -> ModelRunnerOutput:
        if self._output is None:
            self._output = self._collect()
            self._collect = None
        return self._output
