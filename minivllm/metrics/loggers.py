"""Stat loggers: the periodic log line and the Prometheus metrics, with vLLM's names.

Both take the same two inputs: SchedulerStats (a snapshot of the engine core's scheduler,
with cumulative counters) and IterationStats (what the frontend saw since the last record).
"""

from __future__ import annotations

import logging
import time
import weakref

import prometheus_client

from minivllm.engine.messages import SchedulerStats
from minivllm.metrics.stats import (
    BEST_EFFORT,
    LATENCY_SENSITIVE,
    IterationStats,
    merge_scheduler_stats,
)

logger = logging.getLogger(__name__)

FINISH_REASONS = ("stop", "length", "abort", "error")

# A registry's metric families by name: the loggers of several engine cores (data
# parallelism) share one registry, each with its own ``engine`` label.
_FAMILIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _family(registry, kind, name: str, doc: str, labelnames: list[str], **kwargs):
    """The registry's metric ``name``, made on first use."""
    families = _FAMILIES.setdefault(registry, {})
    if name not in families:
        families[name] = kind(name, doc, labelnames, registry=registry, **kwargs)
    return families[name]


_TTFT_BUCKETS = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
]  # fmt: skip
_ITL_BUCKETS = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
]  # fmt: skip
_REQUEST_LATENCY_BUCKETS = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
]  # fmt: skip


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


class CumulativeCounters:
    """Turns the scheduler's cumulative counters into increments since the last snapshot."""

    FIELDS = (
        "prefix_cache_queries",
        "prefix_cache_hits",
        "num_preemptions",
        "external_prefix_cache_queries",
        "external_prefix_cache_hits",
        "kv_disk_blocks_read",
        "kv_disk_blocks_written",
        "spec_decode_num_drafts",
        "spec_decode_num_draft_tokens",
        "spec_decode_num_accepted_tokens",
    )

    def __init__(self) -> None:
        self.last = dict.fromkeys(self.FIELDS, 0)

    def increments(self, stats: SchedulerStats) -> dict[str, int]:
        deltas = {}
        for name in self.FIELDS:
            value = getattr(stats, name)
            deltas[name] = max(0, value - self.last[name])
            self.last[name] = max(value, self.last[name])
        return deltas


class LoggingStatLogger:
    """Logs vLLM's line every interval: throughput, queue lengths, KV use, prefix hits."""

    def __init__(self, engine_index: int = 0, device: str = "cpu") -> None:
        self.engine_index = engine_index
        from minivllm.platforms import get_platform  # torch, only once a logger is made

        self.kv_label = get_platform(device).kv_cache_usage_label
        self.last_scheduler_stats = SchedulerStats()
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.last_log_time = time.monotonic()
        self.last_prompt_throughput = 0.0
        self.last_generation_throughput = 0.0
        self.spec_counters = CumulativeCounters()  # proposals since the last line

    def record(self, scheduler_stats: SchedulerStats | None, iteration: IterationStats | None):
        if scheduler_stats is not None:
            self.last_scheduler_stats = scheduler_stats
        if iteration is not None:
            self.num_prompt_tokens += iteration.num_prompt_tokens
            self.num_generation_tokens += iteration.num_generation_tokens

    def log(self) -> None:
        now = time.monotonic()
        elapsed = now - self.last_log_time
        prompt_throughput = self.num_prompt_tokens / elapsed if elapsed > 0 else 0.0
        generation_throughput = self.num_generation_tokens / elapsed if elapsed > 0 else 0.0
        self.num_prompt_tokens = self.num_generation_tokens = 0
        self.last_log_time = now
        # An idle server logs at debug level only, to keep the log quiet.
        idle = not any(
            (
                prompt_throughput,
                generation_throughput,
                self.last_prompt_throughput,
                self.last_generation_throughput,
            )
        )
        self.last_prompt_throughput = prompt_throughput
        self.last_generation_throughput = generation_throughput
        stats = self.last_scheduler_stats
        queries = stats.prefix_cache_queries
        hit_rate = stats.prefix_cache_hits / queries if queries else 0.0
        logger.log(
            logging.DEBUG if idle else logging.INFO,
            "Engine %03d: Avg prompt throughput: %.1f tokens/s, Avg generation throughput: "
            "%.1f tokens/s, Running: %d reqs, Waiting: %d reqs, %s: %.1f%%, "
            "Prefix cache hit rate: %.1f%%",
            self.engine_index,
            prompt_throughput,
            generation_throughput,
            stats.num_running_reqs,
            stats.num_waiting_reqs,
            self.kv_label,
            stats.kv_cache_usage * 100,
            hit_rate * 100,
        )
        spec = self.spec_counters.increments(stats)
        if spec["spec_decode_num_drafts"]:  # vLLM's second line, when proposals were checked
            drafted = spec["spec_decode_num_draft_tokens"]
            accepted = spec["spec_decode_num_accepted_tokens"]
            logger.info(
                "SpecDecoding metrics: Mean acceptance length: %.2f, Accepted: %d tokens, "
                "Drafted: %d tokens, Avg Draft acceptance rate: %.1f%%",
                1 + accepted / spec["spec_decode_num_drafts"],
                accepted,
                drafted,
                100 * accepted / drafted if drafted else 0.0,
            )


class PrometheusStatLogger:
    """vLLM's Prometheus metrics (the `vllm:` names), in a registry of its own."""

    def __init__(
        self,
        model_name: str,
        max_model_len: int,
        engine_index: int = 0,
        cache_info: dict[str, str] | None = None,
        registry: prometheus_client.CollectorRegistry | None = None,
        max_loras: int | None = None,
    ) -> None:
        """max_loras: LoRA's (enable_lora), for vllm:lora_requests_info; None: LoRA off."""
        self.registry = registry or prometheus_client.CollectorRegistry()
        labelnames = ["model_name", "engine"]
        labels = (model_name, str(engine_index))
        self.counters = CumulativeCounters()

        self.engine_index = engine_index
        registry = self.registry

        def gauge(name: str, doc: str):
            return _family(registry, prometheus_client.Gauge, name, doc, labelnames).labels(*labels)

        def counter(name: str, doc: str):
            family = _family(registry, prometheus_client.Counter, name, doc, labelnames)
            return family.labels(*labels)

        def histogram(name: str, doc: str, buckets: list):
            family = _family(
                registry, prometheus_client.Histogram, name, doc, labelnames, buckets=buckets
            )
            return family.labels(*labels)

        self.gauge_running = gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches."
        )
        self.gauge_waiting = gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed."
        )
        self.gauge_kv_cache_usage = gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        )
        self.gauge_gpu_cache_usage = gauge(
            "vllm:gpu_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage. DEPRECATED: use vllm:kv_cache_usage_perc.",
        )
        self.counter_prefix_cache_queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        )
        self.counter_prefix_cache_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.counter_preemptions = counter(
            "vllm:num_preemptions", "Cumulative number of preemptions from the engine."
        )
        # The disk prefix cache's (--kv-cache-disk): vLLM's external prefix cache counters,
        # and the blocks it read and wrote. One per SchedulerStats field.
        self.counters_kv_disk = {
            name: counter(prefix + name, doc)
            for prefix, name, doc in (
                (
                    "vllm:",
                    "external_prefix_cache_queries",
                    "External prefix cache queries (the disk cache), in tokens.",
                ),
                (
                    "vllm:",
                    "external_prefix_cache_hits",
                    "External prefix cache hits (the disk cache), in tokens.",
                ),
                ("minivllm:", "kv_disk_blocks_read", "KV blocks read back from the disk cache."),
                ("minivllm:", "kv_disk_blocks_written", "KV blocks written to the disk cache."),
            )
        }
        # Speculative decoding's: one per SchedulerStats field of the same name.
        self.counters_spec_decode = {
            name: counter(f"vllm:{name}", doc)
            for name, doc in (
                ("spec_decode_num_drafts", "Number of spec decoding drafts."),
                ("spec_decode_num_draft_tokens", "Number of draft tokens."),
                ("spec_decode_num_accepted_tokens", "Number of accepted tokens."),
            )
        }
        self.counter_prompt_tokens = counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed."
        )
        self.counter_generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        success = _family(
            registry,
            prometheus_client.Counter,
            "vllm:request_success",
            "Count of successfully processed requests.",
            labelnames + ["finished_reason"],
        )
        self.counter_request_success = {r: success.labels(*labels, r) for r in FINISH_REASONS}
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.histogram_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self.histogram_generation_tokens = histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            token_buckets,
        )
        self.histogram_max_tokens = histogram(
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            token_buckets,
        )
        self.histogram_n = histogram(
            "vllm:request_params_n", "Histogram of the n request parameter.", [1, 2, 5, 10, 20]
        )
        self.histogram_ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            _TTFT_BUCKETS,
        )
        self.histogram_itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            _ITL_BUCKETS,
        )
        self.histogram_tpot = histogram(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds. "
            "DEPRECATED: use vllm:inter_token_latency_seconds.",
            _ITL_BUCKETS,
        )
        self.histogram_e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            _REQUEST_LATENCY_BUCKETS,
        )
        self.histogram_queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            _REQUEST_LATENCY_BUCKETS,
        )
        # minivllm's SLO attainment (the slo scheduling policy's classes): requests finished,
        # and those finished within their targets (best-effort ones have none).
        self.counters_slo = {}
        for kind, doc in (
            ("requests", "Finished requests by SLO class."),
            ("requests_attained", "Finished requests that met every SLO target they set."),
            ("generation_tokens", "Generation tokens of finished requests by SLO class."),
        ):
            slo_counter = _family(
                registry,
                prometheus_client.Counter,
                f"minivllm:slo_{kind}",
                doc,
                labelnames + ["slo_class"],
            )
            self.counters_slo[kind] = {
                c: slo_counter.labels(*labels, c) for c in (LATENCY_SENSITIVE, BEST_EFFORT)
            }
        if cache_info:
            info = _family(
                registry,
                prometheus_client.Gauge,
                "vllm:cache_config_info",
                "Information of the LLMEngine CacheConfig",
                list(cache_info) + ["engine"],
            )
            info.labels(*cache_info.values(), str(engine_index)).set(1)
        # vLLM's: one series per state, its labels the adapters' names (comma-separated)
        # running and waiting, its value when it was last seen; routers read the newest.
        self.max_loras = max_loras
        self.gauge_lora_info = None
        if max_loras is not None:
            self.gauge_lora_info = _family(
                registry,
                prometheus_client.Gauge,
                "vllm:lora_requests_info",
                "Running stats on lora requests.",
                ["running_lora_adapters", "max_lora", "waiting_lora_adapters"],
            )

    def record(self, scheduler_stats: SchedulerStats | None, iteration: IterationStats | None):
        if scheduler_stats is not None:
            self.gauge_running.set(scheduler_stats.num_running_reqs)
            self.gauge_waiting.set(scheduler_stats.num_waiting_reqs)
            self.gauge_kv_cache_usage.set(scheduler_stats.kv_cache_usage)
            self.gauge_gpu_cache_usage.set(scheduler_stats.kv_cache_usage)
            deltas = self.counters.increments(scheduler_stats)
            self.counter_prefix_cache_queries.inc(deltas["prefix_cache_queries"])
            self.counter_prefix_cache_hits.inc(deltas["prefix_cache_hits"])
            self.counter_preemptions.inc(deltas["num_preemptions"])
            for name, disk_counter in self.counters_kv_disk.items():
                disk_counter.inc(deltas[name])
            for name, spec_counter in self.counters_spec_decode.items():
                spec_counter.inc(deltas[name])
            if self.gauge_lora_info is not None:
                self.gauge_lora_info.labels(
                    running_lora_adapters=",".join(scheduler_stats.running_lora_adapters),
                    max_lora=str(self.max_loras),
                    waiting_lora_adapters=",".join(scheduler_stats.waiting_lora_adapters),
                ).set_to_current_time()
        if iteration is None:
            return
        self.counter_prompt_tokens.inc(iteration.num_prompt_tokens)
        self.counter_generation_tokens.inc(iteration.num_generation_tokens)
        for ttft in iteration.time_to_first_tokens:
            self.histogram_ttft.observe(ttft)
        for itl in iteration.inter_token_latencies:
            self.histogram_itl.observe(itl)
            self.histogram_tpot.observe(itl)
        for finished in iteration.finished_requests:
            if finished.finish_reason in self.counter_request_success:
                self.counter_request_success[finished.finish_reason].inc()
            self.histogram_e2e.observe(finished.e2e_latency)
            if finished.queued_time is not None:
                self.histogram_queue_time.observe(finished.queued_time)
            self.histogram_prompt_tokens.observe(finished.num_prompt_tokens)
            self.histogram_generation_tokens.observe(finished.num_generation_tokens)
            self.histogram_n.observe(finished.n)
            if finished.max_tokens_param:
                self.histogram_max_tokens.observe(finished.max_tokens_param)
            slo = self.counters_slo
            slo["requests"][finished.slo_class].inc()
            slo["requests_attained"][finished.slo_class].inc(finished.slo_attained)
            slo["generation_tokens"][finished.slo_class].inc(finished.num_generation_tokens)

    def render(self) -> bytes:
        """The metrics in Prometheus' text format."""
        return prometheus_client.generate_latest(self.registry)


class StatLoggerManager:
    """Hands every record to each logger: Prometheus always (the engine core's own, by its
    index, with data parallelism), the log line unless disabled."""

    def __init__(
        self,
        prometheus: PrometheusStatLogger | list[PrometheusStatLogger],
        logging_logger: LoggingStatLogger | None,
    ) -> None:
        """prometheus: one logger per engine core, sharing one registry (the first renders
        them all)."""
        loggers = prometheus if isinstance(prometheus, list) else [prometheus]
        self.prometheus = loggers[0]
        self.by_engine = {p.engine_index: p for p in loggers}
        self.logging_logger = logging_logger

    def record(
        self,
        scheduler_stats: SchedulerStats | None = None,
        iteration: IterationStats | None = None,
        engine_index: int | None = None,
    ) -> None:
        """engine_index: whose scheduler_stats (else the iteration's engine core)."""
        if engine_index is None:
            engine_index = iteration.engine_index if iteration is not None else 0
        self.by_engine.get(engine_index, self.prometheus).record(scheduler_stats, iteration)
        if self.logging_logger is not None:
            self.logging_logger.record(scheduler_stats, iteration)

    def record_engines(self, stats: list[SchedulerStats | None]) -> None:
        """Each engine core's scheduler statistics (None: a core that died); the log line
        takes them together."""
        for index, engine_stats in enumerate(stats):
            if engine_stats is not None and index in self.by_engine:
                self.by_engine[index].record(engine_stats, None)
        if self.logging_logger is not None:
            self.logging_logger.record(merge_scheduler_stats(stats), None)

    def log(self) -> None:
        if self.logging_logger is not None:
            self.logging_logger.log()
