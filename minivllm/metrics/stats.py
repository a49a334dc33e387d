"""Per-request statistics, measured in the frontend as a request's outputs arrive.

A RequestStateStats follows one request (all its n sequences); each output it sees adds to
an IterationStats (tokens, time to first token, inter-token latencies, finished requests),
which the stat loggers record. The OutputProcessor keeps one per request in the engine core
and records each step's IterationStats into the stat logger its frontend gives it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from minivllm.engine.messages import SchedulerStats
from minivllm.slo_params import SLOParams

# The request classes of the slo scheduling policy, as the SLO metrics label them.
LATENCY_SENSITIVE, BEST_EFFORT = "latency_sensitive", "best_effort"


@dataclass
class FinishedRequestStats:
    finish_reason: str  # "stop", "length", "abort" or "error"
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int
    max_tokens_param: int | None = None
    n: int = 1
    queued_time: float | None = None  # only when the engine reports it
    slo_class: str = BEST_EFFORT
    # Finished ("stop" or "length") within every target its class set: TTFT, and the mean
    # TPOT after the first token, as vLLM's benchmark measures them.
    slo_attained: bool = True


@dataclass
class IterationStats:
    """What happened to the requests since the last record (one output, or a batch)."""

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
    engine_index: int = 0  # the engine core whose outputs these are (data parallelism)


class RequestStateStats:
    """Follows one request (its n sequences) through its outputs.

    The outputs must be deltas (RequestOutputKind.DELTA): each carries the tokens that are
    new since the last one, for one sequence or several. As in vLLM, where the n sequences
    are n requests in the engine, prompt tokens and finished requests count per sequence.
    """

    def __init__(
        self,
        num_prompt_tokens: int,
        n: int = 1,
        max_tokens: int | None = None,
        arrival_time: float | None = None,
        slo: SLOParams | None = None,
    ) -> None:
        """slo: the request's targets, the server's defaults filled in (None: best-effort)."""
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.slo = slo
        self.first_token_time: dict[int, float] = {}
        self.num_prompt_tokens = num_prompt_tokens
        self.n = n
        self.max_tokens = max_tokens
        self.last_token_time: dict[int, float] = {}  # sequence index -> its last token's time
        self.num_generation_tokens: dict[int, int] = {}
        self.finished_indices: set[int] = set()

    def update(self, output, iteration: IterationStats, now: float | None = None) -> None:
        """Add one RequestOutput (a delta) to iteration."""
        now = time.monotonic() if now is None else now
        metrics = getattr(output, "metrics", None)
        queued = metrics.get("time_in_queue") if isinstance(metrics, dict) else None
        for completion in output.outputs:
            self.add_tokens(completion.index, len(completion.token_ids), iteration, now)
            if completion.finish_reason is not None:
                self.finish(completion.index, completion.finish_reason, iteration, now, queued)

    def add_tokens(self, index: int, num_new: int, iteration: IterationStats, now: float) -> None:
        """Sequence `index` produced num_new more tokens at `now`."""
        if not num_new:
            return
        counts = self.num_generation_tokens
        counts[index] = counts.get(index, 0) + num_new
        iteration.num_generation_tokens += num_new
        last = self.last_token_time.get(index)
        if last is None:
            self.first_token_time[index] = now
            # The sequence's prompt has been processed: count it now, as vLLM does.
            iteration.num_prompt_tokens += self.num_prompt_tokens
            iteration.time_to_first_tokens.append(now - self.arrival_time)
        else:
            iteration.inter_token_latencies.append(now - last)
        self.last_token_time[index] = now

    def finish(
        self,
        index: int,
        finish_reason: str,
        iteration: IterationStats,
        now: float,
        queued_time: float | None = None,
    ) -> None:
        """Sequence `index` ended (counted once, however often it is said)."""
        if index in self.finished_indices:
            return
        self.finished_indices.add(index)
        iteration.finished_requests.append(
            FinishedRequestStats(
                finish_reason=finish_reason,
                e2e_latency=now - self.arrival_time,
                num_prompt_tokens=self.num_prompt_tokens,
                num_generation_tokens=self.num_generation_tokens.get(index, 0),
                max_tokens_param=self.max_tokens,
                n=self.n,
                queued_time=queued_time,
                slo_class=self.slo_class,
                slo_attained=self._attained(index, finish_reason, now),
            )
        )

    def abort_unfinished(self, iteration: IterationStats, now: float | None = None) -> None:
        """Count the sequences that had not finished as aborted (the client went away)."""
        now = time.monotonic() if now is None else now
        for index in range(self.n):
            self.finish(index, "abort", iteration, now)

    @property
    def slo_class(self) -> str:
        sensitive = self.slo is not None and self.slo.is_latency_sensitive
        return LATENCY_SENSITIVE if sensitive else BEST_EFFORT

    def _attained(self, index: int, finish_reason: str, now: float) -> bool:
        if finish_reason not in ("stop", "length"):
            return False
        if self.slo is None:
            return True
        first = self.first_token_time.get(index)
        if first is None:
            return self.slo.ttft is None and self.slo.tpot is None
        if self.slo.ttft is not None and first - self.arrival_time > self.slo.ttft:
            return False
        num_tokens = self.num_generation_tokens.get(index, 0)
        if self.slo.tpot is not None and num_tokens > 1:
            return (now - first) / (num_tokens - 1) <= self.slo.tpot
        return True


def merge_scheduler_stats(stats: list[SchedulerStats | None]) -> SchedulerStats:
    """Several engine cores' statistics (data parallelism; None for one that died) as one
    engine's: counts and counters summed, the KV cache use averaged over the live ones."""
    live = [s for s in stats if s is not None]
    merged: dict[str, Any] = {}
    for name in SchedulerStats.__struct_fields__:
        values = [getattr(s, name) for s in live]
        if name == "kv_cache_usage":
            merged[name] = sum(values) / len(values) if values else 0.0
        elif name == "slo_step_time_model":  # the first live core's, as admission uses
            merged[name] = next((v for v in values if v), [])
        elif values and isinstance(values[0], dict):
            total: dict[str, int] = {}
            for value in values:
                for key, count in value.items():
                    total[key] = total.get(key, 0) + count
            merged[name] = total
        else:
            merged[name] = sum(values)
    return SchedulerStats(**merged)
