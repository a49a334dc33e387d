"""The scheduler: one token budget per step, no prefill or decode phases.

Each request has num_tokens (prompt + output) and num_computed_tokens (KV in the cache);
every step hands out up to max_num_batched_tokens so the second catches up with the
first. Chunked prefill, prefix-cache hits and resumption after preemption are all this.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from minivllm import envs
from minivllm.config import CacheConfig, SchedulerConfig
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.request import Request, RequestStatus
from minivllm.core.request_progress import fit_drafts, stop_triggers
from minivllm.core.sched_output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from minivllm.core.scheduler_state import check_scheduler_invariants, make_scheduler_stats
from minivllm.core.step_outputs import update_from_output
from minivllm.core.step_policy import make_step_policy
from minivllm.engine.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    SchedulerStats,
)
from minivllm.kv_offload.disk_tier import DiskTier

if TYPE_CHECKING:
    from minivllm.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        structured_output_manager: StructuredOutputManager | None = None,
        max_loras: int | None = None,
        num_state_slots: int = 0,
    ) -> None:
        """max_loras: how many adapters one step may mix (None: LoRA is off).
        num_state_slots: the state cache's slots of a hybrid model (0: it keeps none)."""
        self.config = scheduler_config
        self.max_loras = max_loras
        self.max_model_len = scheduler_config.max_model_len
        self.kv_cache_manager = KVCacheManager(
            num_blocks,
            cache_config.block_size,
            enable_caching=cache_config.enable_prefix_caching,
            hash_algo=cache_config.prefix_caching_hash_algo,
            num_state_slots=num_state_slots,
            disk=DiskTier.from_cache_config(cache_config),
        )
        self.requests: dict[str, Request] = {}
        # Who runs first, how much of the budget each may take, whom to preempt.
        self.policy = make_step_policy(scheduler_config)
        self.waiting = self.policy.make_waiting_queue()
        self.running: list[Request] = []
        # Forgotten since the last step: the runner drops their state.
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        self.structured_output_manager = structured_output_manager
        # Requests under a grammar (while none is here, no step looks for their rows).
        self.num_constrained = 0
        # Outputs of requests finished outside a step (a grammar that failed to compile).
        self._pending_outputs: list[EngineCoreOutput] = []
        # (Not under the slo policy: a step without the running decodes would break their
        # TPOT targets.)
        self.prefill_first = envs.MINIVLLM_PREFILL_FIRST and scheduler_config.policy != "slo"
        # Async scheduling: a request's next token may be scheduled before the last one is
        # back (Request.num_output_placeholders); requests that sample from their own
        # outputs on the host make the engine core step one at a time while they are here.
        self.async_scheduling = scheduler_config.async_scheduling
        self.num_sync_requests = 0
        # The batch queue (pipeline parallelism: several steps in flight) sets these: the
        # requests of steps launched and not yet collected, never scheduled or preempted
        # until their step's output is in (None: one step at a time); and how many steps
        # may be in flight, over which the running requests are spread (a step takes at
        # most its share of them, so that every pipeline stage has a batch).
        self.in_flight: set[str] | None = None
        self.max_concurrent_batches = 1
        # Speculative decoding, cumulative: steps with proposals, tokens proposed, accepted.
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    # -- requests in and out -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.policy.check_admission(request)  # a ValueError refuses it, before anything
        constraint = request.sampling_params.structured_outputs
        if constraint is not None and self.structured_output_manager is not None:
            # Compiles in a thread; the request waits until its grammar is ready.
            request.structured_output_request = self.structured_output_manager.new_request(
                constraint, request.max_tokens
            )
            request.status = RequestStatus.WAITING_FOR_FSM
            self.num_constrained += 1
        request.stop_triggers = stop_triggers(request, self.max_model_len)
        # Registered last: a request that failed above leaves nothing behind.
        if reads_own_outputs(request):
            self.num_sync_requests += 1
        self.requests[request.request_id] = request
        self.waiting.add_request(request)
        self.policy.request_added(request)

    def reject_request(self, request_id: str) -> None:
        """A request that could not be added: its "error" output goes out with the next step."""
        self._pending_outputs.append(_error_output(request_id))

    def finish_requests(self, request_ids: str | list[str], status: RequestStatus) -> None:
        """Finish requests from outside (abort, or a stop string seen by the frontend)."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        waiting_to_remove = set()
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                waiting_to_remove.add(request)
            request.status = status
            self._free_request(request)
        if waiting_to_remove:
            self.waiting.remove_requests(waiting_to_remove)

    def _free_request(self, request: Request) -> None:
        if reads_own_outputs(request):
            self.num_sync_requests -= 1
        if request.structured_output_request is not None:
            self.num_constrained -= 1
        self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]
        self.policy.request_freed(request)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0 or bool(self._pending_outputs)

    def needs_previous_outputs(self) -> bool:
        """Whether the next schedule must wait for the step in flight: some request's
        sampling reads its outputs on the host (always, without async scheduling)."""
        return not self.async_scheduling or self.num_sync_requests > 0

    # -- one step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData()
        preempted: set[str] = set()
        spec: dict[str, list[int]] = {}
        kv = self.kv_cache_manager

        self.policy.begin_step(self.running, self.waiting)
        # Running requests first, in order; or, in a prefill-only step, none.
        prefill_only = self._prefill_only_step()
        if not prefill_only:
            budget = self._schedule_running(budget, num_scheduled, cached, preempted, spec)

        # Then waiting requests, while nothing was preempted this step.
        skipped: list[Request] = []  # still compiling their grammar: they keep their place
        # A step mixes at most max_loras adapters; a request needing another waits, as does
        # one whose group has had its fair share of the step (policy.defers).
        loras = {r.lora_int_id for r in self.running if r.lora_request is not None}
        while (
            not preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting.peek_request()
            if request.status == RequestStatus.WAITING_FOR_FSM and not self._grammar_ready(request):
                self.waiting.pop_request()
                if request.structured_output_request.failed:
                    self._fail_grammar(request)
                else:
                    skipped.append(request)
                continue
            if self.policy.defers(request) or (
                request.lora_request is not None
                and request.lora_int_id not in loras
                and len(loras) >= self.max_loras
            ):
                skipped.append(self.waiting.pop_request())
                continue
            computed_blocks, num_computed = kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_computed
            if num_new > budget and not self.config.enable_chunked_prefill:
                break  # the whole prompt waits for a step with room for it
            num_new = min(num_new, budget)
            fitted = self.policy.fit(request, num_new, num_computed)
            if fitted <= 0 or (fitted < num_new and not self.config.enable_chunked_prefill):
                break  # the policy keeps it waiting: the step has no time left for it
            num_new = fitted
            new_blocks = kv.allocate_slots(request, num_new, computed_blocks, num_computed)
            if new_blocks is None:
                break
            self.policy.commit(request, num_new, num_computed)
            kv.record_prefix_cache_stats(request, num_computed)
            self.waiting.pop_request()
            self.running.append(request)
            if request.lora_request is not None:
                loras.add(request.lora_int_id)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_computed
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            new_reqs.append(
                NewRequestData(
                    req_id=request.request_id,
                    token_ids=list(request.all_token_ids),
                    num_prompt_tokens=request.num_prompt_tokens,
                    sampling_params=request.sampling_params,
                    eos_token_id=request.eos_token_id,
                    block_ids=kv.get_block_ids(request.request_id),
                    num_computed_tokens=num_computed,
                    pooling_params=request.pooling_params,
                    lora_request=request.lora_request,
                    state_slot=kv.get_state_slot(request.request_id),
                )
            )

        for request in reversed(skipped):
            self.waiting.prepend_request(request)
        if prefill_only and not num_scheduled:
            # No request could start (no room in the KV cache, or every waiting one still
            # compiles its grammar): the decodes run after all.
            self._schedule_running(budget, num_scheduled, cached, preempted, spec)

        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=self.finished_req_ids | preempted,
            preempted_req_ids=preempted,
            scheduled_spec_decode_tokens=spec,
            kv_transfers=self.kv_cache_manager.take_kv_transfers(),
        )
        self.finished_req_ids = set()
        if self.in_flight is not None:
            self.in_flight.update(num_scheduled)
        # The tokens are as good as computed: the next schedule() plans from there.
        requests = self.requests
        if not self.async_scheduling:
            for req_id, n in num_scheduled.items():
                requests[req_id].num_computed_tokens += n
        else:
            for req_id, n in num_scheduled.items():
                request = requests[req_id]
                request.num_computed_tokens += n
                if (
                    request.pooling_params is None
                    and request.num_computed_tokens
                    == len(request.all_token_ids) + request.num_output_placeholders
                ):
                    request.num_output_placeholders += 1  # this step samples its next token
        if self.num_constrained:
            self.structured_output_manager.add_grammar_bitmask(output, requests)
        return output

    def _prefill_only_step(self) -> bool:
        """Whether this step only starts waiting requests (MINIVLLM_PREFILL_FIRST): their
        first tokens come sooner by the decodes' share of a step, and each running request's
        next token comes a step later. Not while a started prompt has chunks left: those
        steps mix, so a long prompt never stalls the decodes, which free the KV cache it may
        need."""
        return (
            self.prefill_first
            and bool(self.waiting)
            and len(self.running) < self.config.max_num_seqs
            and all(r.num_tokens - r.num_computed_tokens <= 1 for r in self.running)
        )

    def _schedule_running(
        self,
        budget: int,
        num_scheduled: dict[str, int],
        cached: CachedRequestData,
        preempted: set[str],
        spec: dict[str, list[int]],
    ) -> int:
        """Schedule running requests in order, preempting the victim policy's pick when the
        KV cache is full; a request's proposed tokens (speculative decoding) go into spec,
        as many as the budget, max_tokens and max_model_len leave room for. Returns the
        budget left."""
        kv = self.kv_cache_manager
        in_flight = self.in_flight
        running = self.running
        max_model_len = self.max_model_len
        share = len(running)
        if in_flight is not None:
            share = -(-len(running) // self.max_concurrent_batches)
        # Asked about each request only in a step it shapes (the usual step: not at all).
        policy = self.policy if self.policy.shapes_step() else None
        taken = 0
        i = 0
        while i < len(running) and budget > 0 and taken < share:
            request = running[i]
            if in_flight is not None and request.request_id in in_flight:
                i += 1  # its step is not back yet
                continue
            num_tokens = len(request.all_token_ids)
            computed = request.num_computed_tokens
            placeholders = request.num_output_placeholders
            if placeholders and (
                num_tokens - request.num_prompt_tokens + placeholders >= request.max_tokens
                or num_tokens + placeholders >= max_model_len
            ):
                i += 1  # the token in flight is its last, whatever it is
                continue
            num_known = num_tokens + placeholders - computed
            drafts = None
            num_new = num_known
            if request.spec_token_ids:
                drafts = fit_drafts(request, num_known, budget, max_model_len)
                num_new += len(drafts)
            # Never compute a position at or past max_model_len.
            num_new = min(num_new, budget, max_model_len - computed)
            if policy is not None:
                num_new = policy.fit(request, num_new, computed)
            if num_new <= 0:
                i += 1
                continue
            new_blocks = kv.allocate_slots(request, num_new)
            while new_blocks is None:
                victim = self.policy.pick_victim(self._preemptible())
                if running.index(victim) < i:
                    i -= 1
                running.remove(victim)
                if victim.request_id in num_scheduled:
                    # Already scheduled this step: give its tokens back and drop it from the diff.
                    n = num_scheduled.pop(victim.request_id)
                    budget += n
                    spec.pop(victim.request_id, None)
                    j = cached.req_ids.index(victim.request_id)
                    self.policy.release(victim, n, cached.num_computed_tokens[j])
                    for lst in (cached.req_ids, cached.new_block_ids, cached.num_computed_tokens):
                        del lst[j]
                self._preempt(victim)
                preempted.add(victim.request_id)
                if victim is request:
                    break
                new_blocks = kv.allocate_slots(request, num_new)
            if new_blocks is None:
                break  # the request itself was preempted: no room for anything else
            if policy is not None:
                policy.commit(request, num_new, computed)
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            if drafts:
                drafts = drafts[: max(num_new - num_known, 0)]
                if drafts:
                    spec[request.request_id] = drafts
            cached.req_ids.append(request.request_id)
            cached.new_block_ids.append([b.block_id for b in new_blocks] if new_blocks else [])
            cached.num_computed_tokens.append(computed)
            taken += 1
            i += 1
        return budget

    def _preemptible(self) -> list[Request]:
        """The running requests whose blocks may be taken: none whose step is in flight."""
        if not self.in_flight:
            return self.running
        return [r for r in self.running if r.request_id not in self.in_flight]

    # -- structured outputs --------------------------------------------------------------

    def _grammar_ready(self, request: Request) -> bool:
        if not self.structured_output_manager.is_ready(request.structured_output_request):
            return False
        request.status = (
            RequestStatus.PREEMPTED if request.num_preemptions else RequestStatus.WAITING
        )
        return True

    def _fail_grammar(self, request: Request) -> None:
        """Its grammar failed to compile, or its matcher to start: it fails alone."""
        error = request.structured_output_request.error
        logger.error("Request %s: its grammar failed: %s", request.request_id, error)
        self._pending_outputs.append(self._finish_with_error(request))

    def _finish_with_error(self, request: Request) -> EngineCoreOutput:
        """Finish a request, already out of the queues, whose own processing failed."""
        request.status = RequestStatus.FINISHED_ERROR
        self._free_request(request)
        return _error_output(request.request_id)

    def _preempt(self, request: Request) -> None:
        """Free the request's blocks and send it back to the waiting queue's front."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0  # a token in flight is dropped, and recomputed
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend_request(request)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        """Append sampled tokens, check the stop conditions, and free finished requests."""
        return update_from_output(self, scheduler_output, runner_output)

    def make_stats(self) -> SchedulerStats:
        return make_scheduler_stats(self)

    def check_invariants(self) -> None:
        """Raise AssertionError if the queues or the KV cache bookkeeping are inconsistent
        (cheap enough to call after every step in tests)."""
        check_scheduler_invariants(self)


def reads_own_outputs(request: Request) -> bool:
    """A request whose sampling reads its earlier outputs on the host (a pooling one samples
    nothing)."""
    return request.pooling_params is None and request.sampling_params.reads_own_outputs


def _error_output(request_id: str) -> EngineCoreOutput:
    return EngineCoreOutput(
        request_id=request_id, new_token_ids=[], finish_reason=FinishReason.ERROR
    )
