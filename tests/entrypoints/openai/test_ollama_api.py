"""Ollama's API through the real `ollama` Python client against `minivllm serve`: chat
and generate, streamed (NDJSON) and whole, the same text as the OpenAI routes; list,
show, ps and version; errors in Ollama's shape."""

from __future__ import annotations

import json
import os

import ollama
import pytest

from tests.entrypoints.openai.conftest import MAX_MODEL_LEN, MODEL_NAME
from tests.entrypoints.openai.utils import request

pytestmark = pytest.mark.e2e

GREEDY = {"temperature": 0, "num_predict": 16}
ASK = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


@pytest.fixture(scope="module")
def local(server):
    return ollama.Client(host=server.url_root)


def test_chat_says_what_the_chat_api_says_streamed_or_not(local, client):
    whole = local.chat(model=MODEL_NAME, messages=ASK, options=GREEDY, stream=False)
    pieces = list(local.chat(model=MODEL_NAME, messages=ASK, options=GREEDY, stream=True))
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, max_tokens=16, temperature=0
    )
    assert whole.message.role == "assistant" and whole.done
    assert whole.message.content == chat.choices[0].message.content
    assert "".join(p.message.content for p in pieces) == whole.message.content
    assert pieces[-1].done and not any(p.done for p in pieces[:-1])
    assert pieces[-1].eval_count == whole.eval_count == chat.usage.completion_tokens
    assert whole.prompt_eval_count == chat.usage.prompt_tokens
    assert whole.done_reason == {"stop": "stop", "length": "length"}[chat.choices[0].finish_reason]


def test_generate_templates_the_prompt_and_raw_does_not(local, client):
    prompt = ASK[0]["content"]
    whole = local.generate(model=MODEL_NAME, prompt=prompt, options=GREEDY)
    streamed = "".join(p.response for p in local.generate(
        model=MODEL_NAME, prompt=prompt, options=GREEDY, stream=True))  # fmt: skip
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, max_tokens=16, temperature=0
    )
    assert whole.response == streamed == chat.choices[0].message.content
    raw = local.generate(model=MODEL_NAME, prompt="The capital of France is", raw=True,
                         options=GREEDY)  # fmt: skip
    completion = client.completions.create(
        model=MODEL_NAME, prompt="The capital of France is", max_tokens=16, temperature=0
    )
    assert raw.response == completion.choices[0].text


def test_format_json_gives_json(local):
    reply = local.chat(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Give a city and its country as JSON."}],
        format={"type": "object", "properties": {"city": {"type": "string"}},
                "required": ["city"]},
        options={"temperature": 0, "num_predict": 48},
    )  # fmt: skip
    assert isinstance(json.loads(reply.message.content)["city"], str)


def test_list_show_ps_and_version(local, server, smollm2_path):
    listed = {m.model: m for m in local.list().models}
    assert MODEL_NAME in listed
    shown = local.show(MODEL_NAME)
    assert shown.details.format == "gguf" and "completion" in shown.capabilities
    # Ollama's names (the GGUF's own), and the context this server serves, where clients
    # (VS Code's, Continue's) read the window: <general.architecture>.context_length.
    assert (shown.details.family, shown.details.quantization_level) == ("llama", "Q4_1")
    assert shown.details.parameter_size == "135M"
    assert shown.modelinfo["general.architecture"] == "llama"
    assert shown.modelinfo["llama.context_length"] == MAX_MODEL_LEN
    assert shown.modelinfo["llama.block_count"] == 30
    running = {m.model: m for m in local.ps().models}
    assert MODEL_NAME in running
    # Ollama's sizes: the file on disk in list, the memory (weights and KV cache) in ps.
    assert listed[MODEL_NAME].size == os.path.getsize(smollm2_path)
    assert running[MODEL_NAME].size > listed[MODEL_NAME].size
    status, _, data = request("GET", server.url_for("api", "version"))
    assert status == 200 and json.loads(data)["version"]


def test_errors_have_ollamas_shape(local, server):
    with pytest.raises(ollama.ResponseError) as info:
        local.chat(model="no-such-model", messages=ASK)
    assert info.value.status_code == 404
    status, _, data = request("POST", server.url_for("api", "chat"), {"messages": ASK})
    assert status == 400 and "model is required" in json.loads(data)["error"]
    status, _, data = request(
        "POST", server.url_for("api", "chat"),
        {"model": MODEL_NAME, "messages": ASK, "format": 7, "stream": False},
    )  # fmt: skip
    assert status == 400 and "format" in json.loads(data)["error"]
    assert local.chat(model=MODEL_NAME, messages=ASK, options=GREEDY).message.content
