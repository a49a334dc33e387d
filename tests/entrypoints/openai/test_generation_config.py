"""A served model's generation_config.json fills what a request leaves unset (vLLM's
--generation-config auto): its sampling fields, and max_new_tokens for a chat without
max_tokens."""

from __future__ import annotations

import json

import pytest

from tests.conftest import write_tiny_checkpoint
from tests.entrypoints.openai.utils import RemoteServer


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_tokenizer):
    folder = tmp_path_factory.mktemp("tiny-generation-config")
    write_tiny_checkpoint("llama", str(folder), smollm2_tokenizer)
    config = json.loads((folder / "generation_config.json").read_text())
    # top_k 1 samples the argmax whatever the temperature: the defaults give greedy tokens.
    config.update(temperature=0.7, top_k=1, max_new_tokens=5)
    (folder / "generation_config.json").write_text(json.dumps(config))
    remote = RemoteServer([str(folder), "--max-model-len", "128", "--served-model-name", "tiny"])
    yield remote
    remote.stop()


def test_unset_fields_take_the_generation_config(server):
    client = server.get_client()
    messages = [{"role": "user", "content": "Hello there"}]
    extra = {"ignore_eos": True}
    greedy = client.chat.completions.create(
        model="tiny", messages=messages, temperature=0, max_tokens=5, extra_body=extra
    )
    for _ in range(2):
        # No temperature, top_k or max_tokens: 5 tokens, the argmax each time.
        answer = client.chat.completions.create(model="tiny", messages=messages, extra_body=extra)
        assert answer.usage.completion_tokens == 5
        assert answer.choices[0].message.content == greedy.choices[0].message.content
    # A request's own values win; completions keep their max_tokens default of 16.
    longer = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=9, extra_body=extra
    )
    assert longer.usage.completion_tokens == 9
    completion = client.completions.create(model="tiny", prompt="Hello", extra_body=extra)
    assert completion.usage.completion_tokens == 16
    assert "generation_config.json" in server.log_text()
