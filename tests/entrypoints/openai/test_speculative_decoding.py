"""`minivllm serve --speculative-config ...`, driven by the openai client: streamed and whole
chat completions equal the engine's greedy text without proposals, a stop string inside a
step's several tokens ends the text where it would have, and /metrics counts proposals."""

from __future__ import annotations

import json

import openai
import pytest

from minivllm import LLM, SamplingParams
from tests.entrypoints.openai.utils import RemoteServer, metrics

pytestmark = pytest.mark.e2e

CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"
MESSAGES = [{"role": "user", "content": "Repeat this code exactly:\n\n" + CODE}]
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}


@pytest.fixture(scope="module")
def server():
    remote = RemoteServer(["--speculative-config", json.dumps(SPEC), "--max-model-len", "1024"])
    yield remote
    remote.stop()


@pytest.fixture(scope="module")
def plain(smollm2_path):
    llm = LLM(smollm2_path, enable_multiprocessing=False, max_model_len=1024)
    yield llm
    llm.llm_engine.shutdown()


def test_streamed_and_whole_replies_equal_the_plain_engine(server, plain):
    expected = plain.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=80))[0].outputs[0]
    client = openai.OpenAI(base_url=server.url_for("v1"), api_key="none")
    model = client.models.list().data[0].id
    whole = client.chat.completions.create(
        model=model, messages=MESSAGES, temperature=0, max_tokens=80
    )
    assert whole.choices[0].message.content == expected.text
    assert whole.usage.completion_tokens == len(expected.token_ids)
    stream = client.chat.completions.create(
        model=model, messages=MESSAGES, temperature=0, max_tokens=80, stream=True
    )
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(pieces) == expected.text
    assert len([p for p in pieces if p]) < len(expected.token_ids)  # several tokens a chunk

    stop = SamplingParams(temperature=0, max_tokens=80, stop=["a - b"])
    expected = plain.chat(MESSAGES, stop)[0].outputs[0]
    reply = client.chat.completions.create(
        model=model, messages=MESSAGES, temperature=0, max_tokens=80, stop=["a - b"]
    )
    assert reply.choices[0].message.content == expected.text
    assert reply.choices[0].finish_reason == expected.finish_reason  # (where "a - b" is)
    assert reply.usage.completion_tokens == len(expected.token_ids)

    samples = metrics(server)
    accepted = sum(v for k, v in samples.items() if k.startswith("vllm:spec_decode_num_accepted"))
    drafted = sum(v for k, v in samples.items() if k.startswith("vllm:spec_decode_num_draft_t"))
    assert 0 < accepted <= drafted
