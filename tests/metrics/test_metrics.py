"""Request statistics and the stat loggers, with hand-made outputs (no model)."""

from __future__ import annotations

import logging

import prometheus_client.parser

from minivllm.engine.messages import SchedulerStats
from minivllm.metrics.loggers import (
    LoggingStatLogger,
    PrometheusStatLogger,
    StatLoggerManager,
    build_1_2_5_buckets,
)
from minivllm.metrics.stats import IterationStats, RequestStateStats
from minivllm.outputs import CompletionOutput, RequestOutput


def delta(index: int, token_ids: list[int], finish_reason: str | None = None) -> RequestOutput:
    completion = CompletionOutput(
        index=index, text="x" * len(token_ids), token_ids=token_ids, finish_reason=finish_reason
    )
    return RequestOutput("r", "p", [1, 2, 3], None, [completion], finished=False)


def test_request_stats_follow_each_sequence():
    stats = RequestStateStats(num_prompt_tokens=3, n=2, max_tokens=2, arrival_time=10.0)
    iteration = IterationStats()
    stats.update(delta(0, [5]), iteration, now=11.0)
    stats.update(delta(1, [6]), iteration, now=11.5)
    stats.update(delta(0, [7], "length"), iteration, now=12.0)
    stats.update(delta(1, [], "stop"), iteration, now=13.0)
    assert iteration.num_prompt_tokens == 6  # per sequence, as vLLM counts
    assert iteration.num_generation_tokens == 3
    assert iteration.time_to_first_tokens == [1.0, 1.5]
    assert iteration.inter_token_latencies == [1.0]
    finished = iteration.finished_requests
    assert [(f.finish_reason, f.num_generation_tokens, f.e2e_latency) for f in finished] == [
        ("length", 2, 2.0),
        ("stop", 1, 3.0),
    ]


def test_a_request_closed_early_counts_its_unfinished_sequences_as_aborted():
    stats = RequestStateStats(num_prompt_tokens=3, n=2, max_tokens=8, arrival_time=10.0)
    iteration = IterationStats()
    stats.update(delta(0, [5, 6], "stop"), iteration, now=11.0)
    stats.update(delta(1, [7]), iteration, now=11.5)
    stats.abort_unfinished(iteration, now=12.0)
    stats.abort_unfinished(iteration, now=13.0)  # counted once
    finished = iteration.finished_requests
    assert [(f.finish_reason, f.num_generation_tokens, f.e2e_latency) for f in finished] == [
        ("stop", 2, 1.0),
        ("abort", 1, 2.0),
    ]


def samples(logger: PrometheusStatLogger) -> dict[str, float]:
    result = {}
    for family in prometheus_client.parser.text_string_to_metric_families(logger.render().decode()):
        for sample in family.samples:
            labels = sample.labels.get("finished_reason")
            result[sample.name + (f"[{labels}]" if labels else "")] = sample.value
    return result


def test_prometheus_logger_records_with_vllm_names():
    logger = PrometheusStatLogger("m", max_model_len=100)
    logger.record(
        SchedulerStats(
            num_running_reqs=2,
            num_waiting_reqs=1,
            kv_cache_usage=0.25,
            prefix_cache_queries=40,
            prefix_cache_hits=16,
            num_preemptions=1,
        ),
        None,
    )
    # The scheduler's counters are cumulative: only the increase is added.
    logger.record(SchedulerStats(prefix_cache_queries=50, prefix_cache_hits=16), None)
    iteration = IterationStats(num_prompt_tokens=3, num_generation_tokens=2)
    stats = RequestStateStats(3, max_tokens=2, arrival_time=0.0)
    stats.update(delta(0, [1]), iteration, now=0.5)
    stats.update(delta(0, [2], "stop"), iteration, now=0.7)
    logger.record(None, iteration)
    got = samples(logger)
    assert got["vllm:num_requests_running"] == 0
    assert got["vllm:kv_cache_usage_perc"] == 0.0
    assert got["vllm:prefix_cache_queries_total"] == 50
    assert got["vllm:prefix_cache_hits_total"] == 16
    assert got["vllm:num_preemptions_total"] == 1
    assert got["vllm:prompt_tokens_total"] == 6
    assert got["vllm:generation_tokens_total"] == 4
    assert got["vllm:request_success_total[stop]"] == 1
    assert got["vllm:request_success_total[length]"] == 0
    assert got["vllm:time_to_first_token_seconds_count"] == 1
    assert got["vllm:time_to_first_token_seconds_sum"] == 0.5
    assert got["vllm:inter_token_latency_seconds_count"] == 1
    assert got["vllm:e2e_request_latency_seconds_sum"] == 0.7
    assert got["vllm:request_queue_time_seconds_count"] == 0  # the engine reports none yet


def test_lora_requests_info_names_the_adapters_running_and_waiting():
    import prometheus_client

    logger = PrometheusStatLogger("m", max_model_len=100, max_loras=2)
    logger.record(
        SchedulerStats(running_lora_adapters={"sql": 2, "chat": 1}, waiting_lora_adapters={"x": 1}),
        None,
    )
    logger.record(SchedulerStats(), None)
    series = {}
    for family in prometheus_client.parser.text_string_to_metric_families(logger.render().decode()):
        for sample in family.samples:
            if sample.name == "vllm:lora_requests_info":
                labels = sample.labels
                key = (labels["running_lora_adapters"], labels["waiting_lora_adapters"])
                assert labels["max_lora"] == "2"
                series[key] = sample.value
    assert set(series) == {("sql,chat", "x"), ("", "")}
    assert series[("", "")] >= series[("sql,chat", "x")]  # the newest state, valued last
    assert "lora_requests_info" not in PrometheusStatLogger("m", 100).render().decode()


def test_log_line(caplog):
    log = LoggingStatLogger()
    manager = StatLoggerManager(PrometheusStatLogger("m", 100), log)
    manager.record(
        SchedulerStats(
            num_running_reqs=3,
            num_waiting_reqs=2,
            kv_cache_usage=0.5,
            prefix_cache_queries=100,
            prefix_cache_hits=25,
        ),
        IterationStats(num_prompt_tokens=10, num_generation_tokens=20),
    )
    with caplog.at_level(logging.INFO, logger="minivllm.metrics.loggers"):
        manager.log()
    (record,) = caplog.records
    message = record.getMessage()
    assert message.startswith("Engine 000: Avg prompt throughput: ")
    for part in (
        "Running: 3 reqs",
        "Waiting: 2 reqs",
        "KV cache usage: 50.0%",
        "Prefix cache hit rate: 25.0%",
    ):
        assert part in message
    # Idle: nothing in this interval nor the last: the line drops to debug level.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="minivllm.metrics.loggers"):
        manager.log()
        manager.log()
    assert [r.levelno for r in caplog.records] == [logging.INFO]


def test_buckets():
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(1) == [1]


def test_speculative_decoding_counters_and_log_line(caplog):
    prometheus, log = PrometheusStatLogger("m", 100), LoggingStatLogger()
    manager = StatLoggerManager(prometheus, log)
    spec = dict(spec_decode_num_drafts=4, spec_decode_num_draft_tokens=12)
    manager.record(SchedulerStats(**spec, spec_decode_num_accepted_tokens=6), None)
    with caplog.at_level(logging.INFO, logger="minivllm.metrics.loggers"):
        manager.log()
    line = caplog.records[-1].getMessage()
    assert line.startswith("SpecDecoding metrics: Mean acceptance length: 2.50")
    assert "Accepted: 6 tokens" in line and "Avg Draft acceptance rate: 50.0%" in line
    # Counters take the increase; a log interval with no proposals has no such line.
    manager.record(SchedulerStats(**spec, spec_decode_num_accepted_tokens=7), None)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="minivllm.metrics.loggers"):
        manager.log()
    assert not any("SpecDecoding" in r.getMessage() for r in caplog.records)
    got = samples(prometheus)
    assert got["vllm:spec_decode_num_drafts_total"] == 4
    assert got["vllm:spec_decode_num_draft_tokens_total"] == 12
    assert got["vllm:spec_decode_num_accepted_tokens_total"] == 7


def test_slo_attainment_counters_per_class():
    from minivllm.slo_params import SLOParams

    logger = PrometheusStatLogger("m", max_model_len=100)
    iteration = IterationStats()
    target = SLOParams(True, tpot=0.05, ttft=1.0)
    # On time: first token after 0.5 s, then 4 more in 0.2 s (50 ms each).
    on_time = RequestStateStats(3, max_tokens=5, arrival_time=0.0, slo=target)
    on_time.update(delta(0, [1]), iteration, now=0.5)
    on_time.update(delta(0, [2, 3, 4, 5], "length"), iteration, now=0.7)
    # Slow tokens: 4 in 0.4 s (100 ms each).
    slow = RequestStateStats(3, max_tokens=5, arrival_time=0.0, slo=target)
    slow.update(delta(0, [1]), iteration, now=0.5)
    slow.update(delta(0, [2, 3, 4, 5], "stop"), iteration, now=0.9)
    # A late first token.
    late = RequestStateStats(3, max_tokens=1, arrival_time=0.0, slo=target)
    late.update(delta(0, [1], "length"), iteration, now=1.5)
    # Best-effort: no target; one finished, one the client left.
    done = RequestStateStats(3, max_tokens=1, arrival_time=0.0)
    done.update(delta(0, [1], "length"), iteration, now=9.0)
    left = RequestStateStats(3, max_tokens=4, arrival_time=0.0)
    left.update(delta(0, [1]), iteration, now=1.0)
    left.abort_unfinished(iteration, now=2.0)
    logger.record(None, iteration)
    got = {}
    for family in prometheus_client.parser.text_string_to_metric_families(logger.render().decode()):
        for sample in family.samples:
            if sample.name.startswith("minivllm:slo_") and sample.name.endswith("_total"):
                got[(sample.name, sample.labels["slo_class"])] = sample.value
    assert got == {
        ("minivllm:slo_requests_total", "latency_sensitive"): 3,
        ("minivllm:slo_requests_attained_total", "latency_sensitive"): 1,
        ("minivllm:slo_generation_tokens_total", "latency_sensitive"): 11,
        ("minivllm:slo_requests_total", "best_effort"): 2,
        ("minivllm:slo_requests_attained_total", "best_effort"): 1,
        ("minivllm:slo_generation_tokens_total", "best_effort"): 2,
    }


def test_disk_prefix_cache_counters():
    prometheus = PrometheusStatLogger("m", 100)
    manager = StatLoggerManager(prometheus, LoggingStatLogger())
    disk = dict(external_prefix_cache_queries=64, kv_disk_blocks_written=5)
    manager.record(
        SchedulerStats(**disk, external_prefix_cache_hits=32, kv_disk_blocks_read=2), None
    )
    manager.record(
        SchedulerStats(**disk, external_prefix_cache_hits=48, kv_disk_blocks_read=3), None
    )
    got = samples(prometheus)
    assert got["vllm:external_prefix_cache_queries_total"] == 64
    assert got["vllm:external_prefix_cache_hits_total"] == 48
    assert got["minivllm:kv_disk_blocks_read_total"] == 3
    assert got["minivllm:kv_disk_blocks_written_total"] == 5
