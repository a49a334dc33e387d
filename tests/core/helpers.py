"""Drive the scheduler without a model: synthetic requests and hand-made runner outputs."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

from minivllm.config import CacheConfig, SchedulerConfig
from minivllm.core.request import Request
from minivllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from minivllm.core.scheduler import Scheduler
from minivllm.engine.messages import FinishReason
from minivllm.sampling_params import SamplingParams

EOS = 0


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 16,
    max_model_len: int = 1024,
    enable_prefix_caching: bool = True,
    policy: str = "fcfs",
    hash_algo: str = "sha256",
    enable_chunked_prefill: bool = True,
    async_scheduling: bool = False,
    max_loras: int | None = None,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs,
            max_num_batched_tokens,
            max_model_len,
            policy,
            enable_chunked_prefill,
            async_scheduling,
        ),
        CacheConfig(
            block_size=block_size,
            enable_prefix_caching=enable_prefix_caching,
            prefix_caching_hash_algo=hash_algo,
        ),
        num_blocks,
        max_loras=max_loras,
    )


def make_request(
    req_id: str,
    prompt: list[int],
    max_tokens: int = 4,
    priority: int = 0,
    arrival_time: float = 0.0,
    cache_salt: str | None = None,
    lora_request=None,
    **params,
) -> Request:
    return Request(
        req_id,
        prompt,
        SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params),
        eos_token_id=EOS,
        arrival_time=arrival_time,
        priority=priority,
        cache_salt=cache_salt,
        lora_request=lora_request,
    )


def fake_runner_output(so: SchedulerOutput, sched: Scheduler, token: int = 7) -> ModelRunnerOutput:
    """Sample `token` for every request whose scheduled tokens reach its end."""
    req_ids, sampled = [], []
    for req_id in so.num_scheduled_tokens:
        request = sched.requests[req_id]
        req_ids.append(req_id)
        sampled.append([token] if request.num_computed_tokens >= request.num_tokens else [])
    return ModelRunnerOutput(req_ids, sampled)


def step(sched: Scheduler, token: int = 7):
    so = sched.schedule()
    out = sched.update_from_output(so, fake_runner_output(so, sched, token))
    sched.check_invariants()
    return so, out


def token_at(req_id: str, position: int) -> int:
    """A deterministic 'sampled' token: the same wherever and however often it is computed."""
    return 1 + zlib.crc32(f"{req_id}@{position}".encode()) % 50


@dataclass
class _RunnerState:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    fingerprints: list[int] = field(default_factory=list)

    def fingerprint(self, position: int) -> int:
        """Stands for the K/V at a position: a function of every token up to it."""
        while len(self.fingerprints) <= position:
            i = len(self.fingerprints)
            parent = self.fingerprints[-1] if self.fingerprints else 0
            self.fingerprints.append(hash((parent, self.token_ids[i])))
        return self.fingerprints[position]


class FakeModelRunner:
    """A model runner with a pretend KV cache that checks what attention would read.

    It follows the SchedulerOutputs exactly as the real runner does (new requests once,
    then block-id diffs), writes a fingerprint of each computed position's prefix into the
    slot the block table names, and before sampling checks that every position a request
    attends to holds the fingerprint of the request's own prefix. So a prefix-cache hit on
    a block with the wrong content, a stale hash, a short block table or two requests
    writing one slot all fail loudly. Like the real attention layers, it writes the new
    K/V of the whole batch before any request reads.
    """

    def __init__(self, block_size: int, sample: Callable[[str, int], int] = token_at) -> None:
        self.block_size = block_size
        self.sample = sample
        self.kv: dict[int, int] = {}  # slot -> fingerprint
        self.states: dict[str, _RunnerState] = {}

    def _slot(self, state: _RunnerState, position: int) -> int:
        index = position // self.block_size
        assert index < len(state.block_ids), f"position {position} is past the block table"
        return state.block_ids[index] * self.block_size + position % self.block_size

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in so.finished_req_ids:
            self.states.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.states, f"{new.req_id} sent as new twice"
            self.states[new.req_id] = _RunnerState(
                list(new.token_ids), list(new.block_ids), new.num_computed_tokens
            )
        cached = so.scheduled_cached_reqs
        for req_id, block_ids, computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens
        ):
            state = self.states[req_id]
            state.block_ids.extend(block_ids)
            assert computed == state.num_computed_tokens, f"{req_id}: computed count drifted"

        written: set[int] = set()
        for req_id, n in so.num_scheduled_tokens.items():
            assert n > 0, f"{req_id} scheduled with no tokens"
            state = self.states[req_id]
            for position in range(state.num_computed_tokens, state.num_computed_tokens + n):
                slot = self._slot(state, position)
                assert slot not in written, f"two requests write slot {slot} in one step"
                written.add(slot)
                self.kv[slot] = state.fingerprint(position)

        req_ids, sampled = [], []
        for req_id, n in so.num_scheduled_tokens.items():
            state = self.states[req_id]
            end = state.num_computed_tokens + n
            assert end <= len(state.token_ids), f"{req_id} scheduled past its tokens"
            for position in range(end):
                assert self.kv.get(self._slot(state, position)) == state.fingerprint(position), (
                    f"{req_id} would attend to wrong KV at position {position}"
                )
            state.num_computed_tokens = end
            req_ids.append(req_id)
            if end == len(state.token_ids):
                token = self.sample(req_id, end)
                state.token_ids.append(token)
                sampled.append([token])
            else:
                sampled.append([])
        return ModelRunnerOutput(req_ids, sampled)


class FakeEngine:
    """The scheduler and a FakeModelRunner stepped together, checking every invariant."""

    def __init__(self, sched: Scheduler, runner: FakeModelRunner | None = None) -> None:
        self.sched = sched
        self.runner = runner or FakeModelRunner(sched.kv_cache_manager.block_size)
        self.outputs: dict[str, list[int]] = {}
        self.finish_reasons: dict[str, FinishReason] = {}

    def add(self, request: Request) -> None:
        self.sched.add_request(request)

    def step(self) -> SchedulerOutput:
        sched, runner = self.sched, self.runner
        so = sched.schedule()
        self._apply(sched.update_from_output(so, runner.execute_model(so)))
        return so

    def _apply(self, out) -> None:
        sched, runner = self.sched, self.runner
        sched.check_invariants()
        for request in sched.running:
            state = runner.states[request.request_id]
            # Equal, but for the tokens still in flight under async scheduling.
            known = state.token_ids[: request.num_tokens]
            assert known == request.all_token_ids, f"{request}: runner disagrees"
            assert len(state.token_ids) - request.num_tokens <= request.num_output_placeholders
        for o in out.outputs:
            assert o.request_id not in self.finish_reasons, f"{o.request_id} output after finish"
            self.outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                self.finish_reasons[o.request_id] = o.finish_reason

    def busy(self) -> bool:
        return self.sched.has_unfinished_requests()

    def run(self, max_steps: int = 10_000) -> None:
        """Step until no request is left."""
        for _ in range(max_steps):
            if not self.busy():
                return
            self.step()
        raise AssertionError(f"requests still unfinished after {max_steps} steps")

    def result(self, req_id: str) -> tuple[list[int], FinishReason | None]:
        return self.outputs.get(req_id, []), self.finish_reasons.get(req_id)


class AsyncFakeEngine(FakeEngine):
    """The engine core's order under async scheduling: step N+1 is scheduled and run
    before step N's output reaches the scheduler (the fake runner samples at once, so its
    token lists run one step ahead of the scheduler's)."""

    def __init__(self, sched: Scheduler, runner: FakeModelRunner | None = None) -> None:
        super().__init__(sched, runner)
        self.in_flight: tuple[SchedulerOutput, ModelRunnerOutput] | None = None
        self.overlapped = 0  # steps scheduled while another was in flight

    def _launch(self) -> tuple[SchedulerOutput, ModelRunnerOutput]:
        so = self.sched.schedule()
        return so, self.runner.execute_model(so)

    def step(self) -> SchedulerOutput:
        sched = self.sched
        if self.in_flight is None:
            self.in_flight = self._launch()
        following = None
        if sched.has_unfinished_requests() and not sched.needs_previous_outputs():
            following = self._launch()
            self.overlapped += following[0].total_num_scheduled_tokens > 0
        so, out = self.in_flight
        self.in_flight = following
        self._apply(sched.update_from_output(so, out))
        return so

    def busy(self) -> bool:
        return super().busy() or self.in_flight is not None
