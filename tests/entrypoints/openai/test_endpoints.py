"""The other endpoints: /v1/models, /tokenize, /detokenize, /health, /version, /metrics,
and the periodic statistics log line."""

from __future__ import annotations

import json
import time

import pytest

import minivllm
from tests.entrypoints.openai.conftest import MAX_MODEL_LEN, MODEL_ALIAS, MODEL_NAME
from tests.entrypoints.openai.utils import metric, metrics, post_json, request

pytestmark = pytest.mark.e2e


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME, MODEL_ALIAS]
    card = models.data[0]
    assert card.object == "model"
    assert card.model_extra["max_model_len"] == MAX_MODEL_LEN


def test_health_and_version(server):
    status, _, body = request("GET", server.url_for("health"))
    assert status == 200 and body == b""
    status, _, body = request("GET", server.url_for("version"))
    assert status == 200 and json.loads(body) == {"version": minivllm.__version__}


def test_tokenize_and_detokenize(server, smollm2_tokenizer):
    text = "Hello, world! 北京"
    status, body = post_json(server.url_for("tokenize"), {"prompt": text, "model": MODEL_NAME})
    assert status == 200
    ids = smollm2_tokenizer.encode(text)
    assert body["tokens"] == ids
    assert body["count"] == len(ids)
    assert body["max_model_len"] == MAX_MODEL_LEN
    assert body["token_strs"] is None
    body = {"prompt": text, "return_token_strs": True}
    status, body = post_json(server.url_for("tokenize"), body)
    assert body["token_strs"] == smollm2_tokenizer.convert_ids_to_tokens(ids)
    status, body = post_json(server.url_for("detokenize"), {"tokens": ids})
    assert status == 200 and body == {"prompt": text}


def test_tokenize_chat_matches_chat_usage(server, client):
    messages = [{"role": "user", "content": "Count to three."}]
    status, body = post_json(server.url_for("tokenize"), {"messages": messages})
    assert status == 200
    completion = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1)
    assert body["count"] == completion.usage.prompt_tokens
    _, without = post_json(
        server.url_for("tokenize"), {"messages": messages, "add_generation_prompt": False}
    )
    assert without["count"] < body["count"]


def test_metrics_names_and_counters(server, client):
    before = metrics(server)
    completion = client.completions.create(
        model=MODEL_NAME, prompt="The sky is", max_tokens=5, extra_body={"ignore_eos": True}
    )
    after = metrics(server)

    def delta(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("vllm:prompt_tokens_total") == completion.usage.prompt_tokens
    assert delta("vllm:generation_tokens_total") == 5
    assert delta("vllm:request_success_total", finished_reason="length") == 1
    assert delta("vllm:time_to_first_token_seconds_count") == 1
    assert delta("vllm:inter_token_latency_seconds_count") == 4
    assert delta("vllm:e2e_request_latency_seconds_count") == 1
    assert delta("vllm:request_prompt_tokens_sum") == completion.usage.prompt_tokens
    assert delta("vllm:request_generation_tokens_sum") == 5
    assert delta("vllm:prefix_cache_queries_total") >= completion.usage.prompt_tokens
    for gauge in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
    ):
        assert metric(after, gauge, model_name=MODEL_NAME) == 0.0
    for name in (
        "vllm:prefix_cache_hits_total",
        "vllm:num_preemptions_total",
        "vllm:request_queue_time_seconds_count",
        "vllm:time_per_output_token_seconds_count",
    ):
        metric(after, name)  # present


def test_prefix_cache_hits_are_counted(server, client):
    prompt = "A long shared prefix that spans more than one KV cache block of sixteen tokens. " * 3
    client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1)
    before = metrics(server)
    client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1)
    after = metrics(server)
    hits = metric(after, "vllm:prefix_cache_hits_total") - metric(
        before, "vllm:prefix_cache_hits_total"
    )
    assert hits >= 16


def test_periodic_stats_log_line(server, client):
    client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=3)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        lines = [line for line in server.log_text().splitlines() if "Engine 000:" in line]
        if lines:
            break
        time.sleep(0.5)
    line = lines[-1]
    for part in (
        "Avg prompt throughput:",
        "Avg generation throughput:",
        "Running:",
        "Waiting:",
        "KV cache usage:",
        "Prefix cache hit rate:",
    ):
        assert part in line
