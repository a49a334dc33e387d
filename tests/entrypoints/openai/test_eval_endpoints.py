"""What evaluation clients read (issue 51): GET /tokenizer_info behind
--enable-tokenizer-info-endpoint (vLLM's flag and answer), and `echo: true` with
`max_tokens: 0` on /v1/completions, the prompt and its logprobs alone (GPT-3-style scoring,
what lm-eval's log-likelihood requests amount to), through the openai SDK and raw HTTP
against a real server."""

from __future__ import annotations

import json

import pytest

from minivllm.entrypoints.openai.tokenizer_info import tokenizer_info
from tests.entrypoints.openai.conftest import MODEL_NAME
from tests.entrypoints.openai.utils import RemoteServer, post_json, request

pytestmark = pytest.mark.e2e

PROMPTS = ["The capital of France is Paris, and the capital of Italy is", "One two three"]


@pytest.fixture(scope="module")
def info_server():
    remote = RemoteServer(
        ["--max-model-len", "256", "--served-model-name", MODEL_NAME,
         "--enable-tokenizer-info-endpoint"]
    )  # fmt: skip
    yield remote
    remote.stop()


@pytest.fixture(scope="module")
def info_client(info_server):
    return info_server.get_client()


# ---------------------------------------------------------------------------- /tokenizer_info


def test_tokenizer_info_is_the_tokenizer_config(info_server, smollm2_tokenizer):
    status, _, data = request("GET", info_server.url_for("tokenizer_info"))
    assert status == 200
    info = json.loads(data)
    assert info["tokenizer_class"] == type(smollm2_tokenizer).__name__
    assert info["eos_token"] == smollm2_tokenizer.eos_token
    assert info["bos_token"] == smollm2_tokenizer.bos_token
    assert info["chat_template"] == smollm2_tokenizer.chat_template
    assert not {"vocab_file", "merges_file", "tokenizer_file"} & set(info)
    # lm-eval's remote tokenizer: eos_token's id through /tokenize, which must be the model's.
    status, tokenized = post_json(
        info_server.url_for("tokenize"), {"prompt": info["eos_token"], "add_special_tokens": False}
    )
    assert status == 200 and tokenized["tokens"] == [smollm2_tokenizer.eos_token_id]


def test_tokenizer_info_is_off_unless_enabled(server):
    status, _, data = request("GET", server.url_for("tokenizer_info"))
    assert status == 404, data


def test_tokenizer_info_takes_the_servers_chat_template_and_added_tokens():
    from tokenizers import AddedToken

    class Tok:
        init_kwargs = {
            "vocab_file": "/secret/vocab.json",
            "eos_token": AddedToken("</s>"),
            "added_tokens_decoder": {3: AddedToken("<x>")},
            "model_max_length": 8,
        }
        bos_token, eos_token, pad_token, unk_token = "<s>", "</s>", None, None
        chat_template = "{{ tokenizer's }}"

    info = tokenizer_info(Tok(), "{{ server's }}")
    assert json.loads(json.dumps(info)) == {
        "eos_token": "</s>",
        "bos_token": "<s>",  # not in the init arguments: read from the tokenizer
        "added_tokens_decoder": {"3": "<x>"},
        "model_max_length": 8,
        "tokenizer_class": "Tok",
        "chat_template": "{{ server's }}",
    }


# ---------------------------------------------------------------------------- echo, max_tokens 0


def scored(client, prompt, **kwargs):
    return client.completions.create(
        model=MODEL_NAME, prompt=prompt, echo=True, max_tokens=0, temperature=0, **kwargs
    )


def test_echo_with_max_tokens_0_is_the_prompt_and_its_logprobs(info_client, smollm2_tokenizer):
    ids = smollm2_tokenizer.encode(PROMPTS[0])
    only = scored(info_client, PROMPTS[0], logprobs=1)
    # The same prompt scored while generating one token: the prompt's part must be equal.
    with_one = info_client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[0], echo=True, max_tokens=1, temperature=0, logprobs=1
    )
    choice, reference = only.choices[0], with_one.choices[0].logprobs
    assert choice.text == PROMPTS[0]
    assert choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == len(ids)
    assert choice.logprobs.tokens == reference.tokens[: len(ids)]
    assert choice.logprobs.text_offset == reference.text_offset[: len(ids)]
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(
        reference.token_logprobs[1 : len(ids)], abs=1e-5
    )
    assert all(len(top) >= 1 for top in choice.logprobs.top_logprobs[1:])
    assert only.usage.prompt_tokens == len(ids) and only.usage.completion_tokens == 0


def test_echo_only_streamed_is_the_same_and_batches(info_client, smollm2_tokenizer):
    whole = scored(info_client, PROMPTS, logprobs=2)
    chunks = list(scored(info_client, PROMPTS, logprobs=2, stream=True))
    for index, prompt in enumerate(PROMPTS):
        streamed = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert "".join(c.text for c in streamed) == prompt == whole.choices[index].text
        tokens = sum((c.logprobs.tokens for c in streamed if c.logprobs), [])
        assert tokens == whole.choices[index].logprobs.tokens
        assert len(tokens) == len(smollm2_tokenizer.encode(prompt))
    # Token ids in, no logprobs asked: the decoded prompt, nothing generated.
    ids = smollm2_tokenizer.encode(PROMPTS[1])
    plain = scored(info_client, ids)
    assert plain.choices[0].text == smollm2_tokenizer.decode(ids)
    assert plain.choices[0].logprobs is None and plain.usage.completion_tokens == 0


def test_max_tokens_0_without_echo_is_a_400(info_server):
    status, body = post_json(
        info_server.url_for("v1", "completions"),
        {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 0},
    )
    assert status == 400, body
    assert "max_tokens" in body["error"]["message"]
