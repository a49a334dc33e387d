"""The `slo` scheduling policy: latency-sensitive requests meet their targets, best-effort
requests take what the targets leave.

Each step is composed against a time limit, with a step-time model (core/step_time_model.py)
fitted from measured steps:

- A running latency-sensitive request with a TPOT target owes its k-th token after the
  first at first_token_time + k * tpot * TPOT_AIM (the mean TPOT of vLLM's benchmark is met
  when every token is on time, and a token ahead of time lends its slack to later steps, up
  to a few targets' worth). The step's limit is the earliest such deadline, less a safety margin.
- Waiting latency-sensitive requests (earliest TTFT deadline first, planned at TTFT_AIM of
  the target) have their prompts' time reserved in the step before any best-effort work is
  placed; best-effort work must also leave the step ending before their TTFT deadlines.
- Latency-sensitive decodes always run; their prompts run in chunks that fit the decodes'
  limit (a few tokens at least, so they progress); best-effort requests take the largest
  chunk that fits every limit (none if nothing does). With no latency-sensitive request
  about, best-effort steps are kept under half the smallest TTFT target seen, so an
  arrival waits little.
- Within core/fair_share.py's shares: the n sequences of one request take at most a fair
  share of the tokens, and a best-effort newcomer (no sequence of its request running) has
  its first chunk reserved while the started requests' waiting sequences stand behind it,
  so a time-limited step cannot keep it out (MINIVLLM_FAIR_SHARE=0: neither).
- Best-effort requests are preempted first (the newest), then the latest latency-sensitive.
- Admission: a latency-sensitive request that could not meet its target even alone (its
  decode step alone exceeds its TPOT, or its prompt alone its TTFT) is refused, unless no
  step has confirmed the model for STALE_MODEL_S (see there).
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from collections.abc import Callable

from minivllm.config import SchedulerConfig
from minivllm.core.fair_share import group_of
from minivllm.core.request import Request, RequestStatus
from minivllm.core.sched_output import SchedulerOutput
from minivllm.core.step_policy import StepPolicy
from minivllm.core.step_time_model import StepShape, StepTimeModel
from minivllm.slo_params import BEST_EFFORT, SLOParams

# The share of a deadline's time a step is planned to take: room for the model's error.
SAFETY = 0.85
# Deadlines are planned at this share of the TPOT target. A request that spends all its
# slack otherwise lands on the target itself, and the client's mean TPOT also carries what
# the step model does not see (the token's way out to the client): at 80% of capacity, 15
# of 108 chats missed 50 ms by under 1 ms (BENCHMARKS, issue 54).
TPOT_AIM = 0.9
# Likewise TTFT deadlines are planned at this share of the target: the client's TTFT also
# carries the request's way in (HTTP, tokenizing) and its first token's way out, which the
# engine's arrival time does not see (at 80% of capacity, with the deadlines on the target
# itself, one chat of 108 had its first token just over 1 s: BENCHMARKS, issue 54).
TTFT_AIM = 0.9
# A token ahead of its deadline lends a later step at most this many targets' time.
MAX_SLACK_TARGETS = 3.0
# A latency-sensitive prompt gets at least this many tokens a step, whatever the limit.
MIN_PROMPT_CHUNK = 16
# A step-time model no step has confirmed for this many seconds refuses nothing. Only steps
# refit it, so a pessimistic model (a calibration or a refit on a busy minute) that refused
# every latency-sensitive request while nothing else ran would never be corrected: the
# server would refuse them for good. After this long without a step the request runs (it
# may miss its targets), and its steps refit the model.
STALE_MODEL_S = 10.0


def targets_of(request: Request, config: SchedulerConfig) -> SLOParams:
    """The request's SLO with the server's defaults filled in (best-effort: none)."""
    params = request.sampling_params.slo_params
    if params is None or request.pooling_params is not None:
        return BEST_EFFORT
    return params.with_defaults(config.default_slo_tpot, config.default_slo_ttft)


def alone_error(
    model: StepTimeModel,
    targets: SLOParams,
    num_prompt_tokens: int,
    max_tokens: int | None,
    config: SchedulerConfig,
    model_age: float,
) -> str | None:
    """Why a latency-sensitive request cannot meet its targets even alone, or None. Checks
    its prompt's steps (chunked by the token budget) against its TTFT, and its decode step
    at its longest context against its TPOT. model_age: seconds since a step last confirmed
    the model; past STALE_MODEL_S nothing is refused."""
    if not targets.is_latency_sensitive or not model.fitted or model_age > STALE_MODEL_S:
        return None
    if targets.ttft is not None:
        prefill, done = 0.0, 0
        while done < num_prompt_tokens:
            n = min(num_prompt_tokens - done, config.max_num_batched_tokens)
            prefill += model.predict(StepShape().with_request(n, done))
            done += n
        if prefill > targets.ttft:
            return (
                f"The request cannot meet its TTFT target ({targets.ttft * 1e3:.0f} ms) even "
                f"alone: its {num_prompt_tokens}-token prompt takes about {prefill * 1e3:.0f} "
                "ms on this server. Shorten the prompt or raise slo_ttft."
            )
    if targets.tpot is not None:
        longest = num_prompt_tokens + (max_tokens or config.max_model_len)
        longest = min(longest, config.max_model_len)
        decode = model.predict(StepShape().with_request(1, max(longest - 1, 0)))
        if decode > targets.tpot:
            return (
                f"The request cannot meet its TPOT target ({targets.tpot * 1e3:.0f} ms per "
                f"token) even alone: one decode step at {longest} tokens of context takes "
                f"about {decode * 1e3:.0f} ms on this server. Raise slo or lower max_tokens."
            )
    return None


class SLOAdmission:
    """The frontend's copy of the admission check, so that a hopeless latency-sensitive
    request is refused before it reaches the engine core (a 400 from the server, not an
    error finish): the core's step-time model, calibrated at start-up and then followed as
    the core refits it (`update`), refusing nothing while no step has confirmed it for
    STALE_MODEL_S, so one slow calibration (a busy machine at start) does not refuse every
    latency-sensitive request for the server's life."""

    def __init__(
        self,
        config: SchedulerConfig,
        coefficients: list[float],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.model = StepTimeModel()
        self.model.load(coefficients)
        self.clock = clock
        self.confirmed_at = clock()  # the last time a step's coefficients came

    @classmethod
    def for_engine(
        cls, config: SchedulerConfig, coefficients: list[float] | None
    ) -> SLOAdmission | None:
        if config.policy != "slo" or not coefficients:
            return None
        return cls(config, coefficients)

    def update(self, coefficients: list[float]) -> None:
        """The core's refitted coefficients (from its scheduler stats; none: unchanged)."""
        if coefficients:
            self.model.load(coefficients)
            self.confirmed_at = self.clock()

    def check(self, num_prompt_tokens: int, params) -> None:
        """Raise ValueError (saying why) for a request that cannot meet its targets alone."""
        slo = getattr(params, "slo_params", None)
        if slo is None:
            return
        targets = slo.with_defaults(self.config.default_slo_tpot, self.config.default_slo_ttft)
        age = self.clock() - self.confirmed_at
        error = alone_error(
            self.model, targets, num_prompt_tokens, params.max_tokens, self.config, age
        )
        if error is not None:
            raise ValueError(error)


class SLORequestQueue:
    """Latency-sensitive requests first, by TTFT deadline (then arrival); best-effort ones
    after them, first come first served. A preempted request goes back to its class's front
    (a latency-sensitive one keeps its deadline's place)."""

    def __init__(self, classify: Callable[[Request], SLOParams]) -> None:
        self._classify = classify
        self._urgent: list[tuple[float, float, str, Request]] = []
        self._best_effort: deque[Request] = deque()

    def _key(self, request: Request, targets: SLOParams) -> tuple[float, float, str, Request]:
        deadline = request.arrival_time + (targets.ttft if targets.ttft is not None else 0.0)
        return (deadline, request.arrival_time, request.request_id, request)

    def add_request(self, request: Request) -> None:
        targets = self._classify(request)
        if targets.is_latency_sensitive:
            heapq.heappush(self._urgent, self._key(request, targets))
        else:
            self._best_effort.append(request)

    def prepend_request(self, request: Request) -> None:
        targets = self._classify(request)
        if targets.is_latency_sensitive:
            heapq.heappush(self._urgent, self._key(request, targets))
        else:
            self._best_effort.appendleft(request)

    def peek_request(self) -> Request:
        return self._urgent[0][3] if self._urgent else self._best_effort[0]

    def pop_request(self) -> Request:
        if self._urgent:
            return heapq.heappop(self._urgent)[3]
        return self._best_effort.popleft()

    def remove_requests(self, requests: set[Request]) -> None:
        self._urgent = [e for e in self._urgent if e[3] not in requests]
        heapq.heapify(self._urgent)
        self._best_effort = deque(r for r in self._best_effort if r not in requests)

    def best_effort_newcomer(self, started: set[str]) -> Request | None:
        """The first best-effort request that could start now (its grammar ready) and whose
        group (core/fair_share.py) is not among the started ones, if any."""
        for request in self._best_effort:
            if request.status != RequestStatus.WAITING_FOR_FSM:
                if group_of(request.request_id) not in started:
                    return request
        return None

    def urgent(self) -> list[Request]:
        """The waiting latency-sensitive requests, earliest deadline first."""
        return [e[3] for e in sorted(self._urgent)]

    def __len__(self) -> int:
        return len(self._urgent) + len(self._best_effort)

    def __bool__(self) -> bool:
        return bool(self._urgent or self._best_effort)

    def __iter__(self):
        yield from self.urgent()
        yield from self._best_effort


class SLOPolicy(StepPolicy):
    def __init__(
        self,
        config: SchedulerConfig,
        model: StepTimeModel | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(config)
        self.model = model if model is not None else StepTimeModel()
        self.clock = clock  # wall-clock seconds, as requests' arrival_time
        self._first_token_at: dict[str, float] = {}
        # The smallest TTFT target seen: best-effort-only steps stay under half of it.
        self._min_ttft = config.default_slo_ttft or math.inf
        self.shape = StepShape()  # what this step holds so far
        self.reserve = StepShape()  # the prompts of waiting latency-sensitive requests
        self._reserved: dict[str, tuple[int, int]] = {}
        # A best-effort newcomer with its first chunk reserved this step, and the groups
        # already started (their best-effort sequences wait behind it).
        self._newcomer: str | None = None
        self._started: set[str] = set()
        # Seconds this step may take: for latency-sensitive prompts (the running decodes'
        # deadlines), and for best-effort work (the TTFT deadlines too).
        self.limit = math.inf
        self.best_effort_limit = math.inf
        self.enabled = True  # off: no time limits (the start-up calibration's steps)
        self._observed_at = clock()  # the last step the model saw (STALE_MODEL_S)

    def targets(self, request: Request) -> SLOParams:
        return targets_of(request, self.config)

    def make_waiting_queue(self) -> SLORequestQueue:
        return SLORequestQueue(self.targets)

    def check_admission(self, request: Request) -> None:
        targets = self.targets(request)
        if targets.ttft is not None:
            self._min_ttft = min(self._min_ttft, targets.ttft)
        error = alone_error(
            self.model,
            targets,
            request.num_prompt_tokens,
            request.sampling_params.max_tokens,
            self.config,
            self.clock() - self._observed_at,
        )
        if error is not None:
            raise ValueError(error)

    # -- composing a step ----------------------------------------------------------------

    def begin_step(self, running: list[Request], waiting) -> None:
        super().begin_step(running, waiting)  # the groups' fair shares
        now = self.clock()
        self.shape, self.reserve, self._reserved = StepShape(), StepShape(), {}
        self._newcomer, self._started = None, set()
        limit = ttft_limit = math.inf
        first_token_at = {}
        urgent_about = False
        for request in running:
            targets = self.targets(request)
            if not targets.is_latency_sensitive:
                continue
            urgent_about = True
            produced = request.num_output_tokens + request.num_output_placeholders
            if produced < 1:
                ttft_limit = min(ttft_limit, self._ttft_room(request, targets, now))
                continue
            first = self._first_token_at.get(request.request_id, now)
            first_token_at[request.request_id] = first
            if targets.tpot is not None:
                aim = targets.tpot * TPOT_AIM
                room = min(first + produced * aim - now, MAX_SLACK_TARGETS * targets.tpot)
                limit = min(limit, room)
        self._first_token_at = first_token_at
        # Latency-sensitive requests are served first; best-effort ones keep their order.
        running.sort(key=lambda r: not self.targets(r).is_latency_sensitive)
        if isinstance(waiting, SLORequestQueue):
            tokens = self.config.max_num_batched_tokens
            room_seqs = self.config.max_num_seqs - len(running)
            for request in waiting.urgent()[: max(room_seqs, 0)]:
                if tokens <= 0:
                    break
                urgent_about = True
                n = min(request.num_tokens - request.num_computed_tokens, tokens)
                self.reserve.add(n, 0)
                self._reserved[request.request_id] = (n, 0)
                tokens -= n
                ttft_limit = min(ttft_limit, self._ttft_room(request, self.targets(request), now))
            started = {group_of(r.request_id) for r in running}
            newcomer = waiting.best_effort_newcomer(started)
            if (
                self.fair_share.enabled
                and newcomer is not None
                and tokens > 0
                and room_seqs > len(self._reserved)
            ):
                # A best-effort newcomer (its request has no sequence running) has its first
                # chunk reserved, and best-effort sequences of started requests wait behind
                # it (defers): they would fill the step's time limit and keep it out until
                # all of them ended (a request of 128 sequences, for one).
                n = min(newcomer.num_tokens, MIN_PROMPT_CHUNK, tokens)
                self.reserve.add(n, 0)
                self._reserved[newcomer.request_id] = (n, 0)
                self._newcomer, self._started = newcomer.request_id, started
        if not urgent_about:
            ttft_limit = self._min_ttft / 2 / SAFETY
        if not self.enabled:
            limit = ttft_limit = math.inf
        self.limit = limit * SAFETY
        self.best_effort_limit = min(limit, ttft_limit) * SAFETY

    def defers(self, request: Request) -> bool:
        if super().defers(request):
            return True
        return (
            self._newcomer is not None
            and group_of(request.request_id) in self._started
            and not self.targets(request).is_latency_sensitive
        )

    def _ttft_room(self, request: Request, targets: SLOParams, now: float) -> float:
        if targets.ttft is None:
            return math.inf
        return request.arrival_time + targets.ttft * TTFT_AIM - now

    def fit(self, request: Request, num_new: int, num_computed: int) -> int:
        targets = self.targets(request)
        reserved = self._reserved.pop(request.request_id, None)
        if reserved is not None:
            self.reserve.remove(*reserved)
        if request.request_id == self._newcomer:
            self._newcomer = None  # it is placed: the started requests' sequences may follow
        decoding = request.num_output_tokens + request.num_output_placeholders >= 1
        if not (targets.is_latency_sensitive and decoding):
            # Its group's fair share (a latency-sensitive decode is never left out).
            num_new = super().fit(request, num_new, num_computed)
        if not targets.is_latency_sensitive:
            cap = self.config.max_num_batched_tokens - self.shape.num_tokens
            cap -= self.reserve.num_tokens
            fitting = self._largest_fitting(min(num_new, cap), num_computed, self.best_effort_limit)
            if not self.shape.num_seqs:
                # First in the step: it progresses, whatever the limit says (a waiting
                # request's reservation may not get its KV blocks, which this one holds).
                fitting = max(fitting, min(num_new, MIN_PROMPT_CHUNK))
            return fitting
        if decoding:
            return num_new  # its decode (and proposals): never left out
        fitting = self._largest_fitting(num_new, num_computed, self.limit)
        return max(fitting, min(num_new, MIN_PROMPT_CHUNK))

    def _largest_fitting(self, num_new: int, num_computed: int, limit: float) -> int:
        """The most of num_new tokens whose step, with the reserve, stays within limit."""
        if num_new <= 0:
            return 0
        if not self.model.fitted or limit == math.inf:
            return num_new
        base = self.shape.merged(self.reserve)
        if self.model.predict(base.with_request(num_new, num_computed)) <= limit:
            return num_new
        lo, hi = 0, num_new  # the predicted time grows with the tokens: bisect
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.model.predict(base.with_request(mid, num_computed)) <= limit:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def shapes_step(self) -> bool:
        return True  # every request's tokens are fitted to the step's time limit

    def commit(self, request: Request, num_new: int, num_computed: int) -> None:
        super().commit(request, num_new, num_computed)
        self.shape.add(num_new, num_computed)

    def release(self, request: Request, num_new: int, num_computed: int) -> None:
        super().release(request, num_new, num_computed)
        self.shape.remove(num_new, num_computed)

    def pick_victim(self, running: list[Request]) -> Request:
        """The newest best-effort request; else the latest-arriving latency-sensitive one."""
        return max(
            running,
            key=lambda r: (not self.targets(r).is_latency_sensitive, r.arrival_time),
        )

    # -- learning ------------------------------------------------------------------------

    def observe_step(self, output: SchedulerOutput, seconds: float) -> None:
        self.model.observe(StepShape.of(output), seconds)
        self._observed_at = self.clock()

    def predicted_time(self) -> float:
        """The step composed so far, as the model predicts it."""
        return self.model.predict(self.shape)
