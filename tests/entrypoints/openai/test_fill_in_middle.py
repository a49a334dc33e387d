"""Fill in the middle: `suffix` on /v1/completions and Ollama's /api/generate lays the prompt
out with the model's FIM tokens (prefix, suffix, middle) and ends the middle at the model's
FIM end tokens; a model without FIM tokens refuses it. A tiny random Qwen2 whose tokenizer
has Qwen2.5-Coder's FIM tokens; the bundled model has none. The real Qwen2.5-Coder's GGUF in
test_a_real_coder_fills_the_hole (slow)."""

from __future__ import annotations

import copy

import ollama
import pytest

from minivllm.entrypoints.openai.fill_in_middle import FillInMiddle
from minivllm.tokenizer import load_tokenizer
from tests.conftest import write_tiny_checkpoint
from tests.entrypoints.openai.conftest import MODEL_NAME
from tests.entrypoints.openai.utils import RemoteServer, post_json

pytestmark = pytest.mark.e2e

FIM_NAME = "tiny-coder"
FIM_TOKENS = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>"]
PREFIX = "def add(a, b):\n    return "
SUFFIX = "\n\nprint(add(1, 2))\n"


@pytest.fixture(scope="module")
def coder_path(tmp_path_factory, smollm2_tokenizer) -> str:
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": FIM_TOKENS})
    return write_tiny_checkpoint("qwen2", str(tmp_path_factory.mktemp("coder")), tokenizer)


@pytest.fixture(scope="module")
def coder_tokenizer(coder_path):
    return load_tokenizer(coder_path)  # as the server loads it


@pytest.fixture(scope="module")
def coder(coder_path):
    server = RemoteServer([coder_path, "--served-model-name", FIM_NAME, "--max-model-len", "256"])
    yield server
    server.stop()


def complete(server, **fields) -> tuple[int, dict]:
    body = {"model": FIM_NAME, "max_tokens": 8, "temperature": 0, **fields}
    return post_json(server.url_for("v1", "completions"), body)


def test_the_prompt_is_prefix_suffix_middle(coder, coder_tokenizer):
    fim = FillInMiddle.of(coder_tokenizer)
    pre, suf, mid = (coder_tokenizer.convert_tokens_to_ids(t) for t in FIM_TOKENS[:3])
    expected = [pre, *coder_tokenizer.encode(PREFIX, add_special_tokens=False), suf,
                *coder_tokenizer.encode(SUFFIX, add_special_tokens=False), mid]  # fmt: skip
    assert fim.prompt_ids(coder_tokenizer, PREFIX, SUFFIX) == expected
    # ignore_eos on both: the same 8 tokens whatever this CPU's greedy path (no end token,
    # FIM's or the model's, can cut one short).
    status, filled = complete(coder, prompt=PREFIX, suffix=SUFFIX, ignore_eos=True)
    assert status == 200, filled
    status, by_hand = complete(coder, prompt=expected, ignore_eos=True)
    assert status == 200, by_hand
    (choice,) = filled["choices"]
    assert choice["text"] == by_hand["choices"][0]["text"]
    assert filled["usage"]["completion_tokens"] == 8
    assert filled["usage"]["prompt_tokens"] == len(expected)


def test_a_middle_ends_at_the_fim_padding(coder, coder_tokenizer):
    pad = coder_tokenizer.convert_tokens_to_ids("<|fim_pad|>")
    forced = {"logit_bias": {str(pad): 100}}
    status, body = complete(coder, prompt=PREFIX, suffix=SUFFIX, **forced)
    assert status == 200, body
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 1
    # Without a suffix the same token is text like any other: no stop.
    status, body = complete(coder, prompt=PREFIX, **forced)
    assert status == 200 and body["choices"][0]["finish_reason"] == "length", body


def test_ollama_generate_with_a_suffix_fills_in(coder):
    client = ollama.Client(host=coder.url_root)
    options = {"temperature": 0, "num_predict": 8}
    reply = client.generate(model=FIM_NAME, prompt=PREFIX, suffix=SUFFIX, options=options)
    status, body = complete(coder, prompt=PREFIX, suffix=SUFFIX)
    assert status == 200, body
    assert reply.response == body["choices"][0]["text"]
    assert "insert" in client.show(FIM_NAME).capabilities  # Ollama's name for FIM


def test_a_many_model_server_lists_insert_before_loading(coder_path, smollm2_path):
    """/api/show of a model not loaded reads its tokenizer for Ollama's insert capability."""
    from types import SimpleNamespace

    from minivllm.entrypoints.openai.model_router import _fills_in

    assert _fills_in(SimpleNamespace(tokenizer=coder_path))
    assert not _fills_in(SimpleNamespace(tokenizer=smollm2_path))
    assert not _fills_in(SimpleNamespace(tokenizer="/no/such/model"))


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"prompt": [1, 2], "suffix": "x"}, "`suffix` needs a text prompt"),
        ({"prompt": "a", "suffix": "x", "echo": True}, "cannot be combined with `echo`"),
        ({"prompt": "a", "suffix": "\ud800"}, "`suffix` is not valid UTF-8"),
    ],
)
def test_bad_fill_in_middle_requests_are_a_400(coder, fields, message):
    status, body = complete(coder, **fields)
    assert status == 400 and message in body["error"]["message"], body


def test_a_model_without_fim_tokens_refuses_a_suffix(server):
    body = {"model": MODEL_NAME, "prompt": "a", "suffix": "b", "max_tokens": 2}
    status, answer = post_json(server.url_for("v1", "completions"), body)
    assert status == 400 and answer["error"]["param"] == "suffix", answer
    assert "trained to fill in the middle" in answer["error"]["message"]
    assert "insert" not in ollama.Client(host=server.url_root).show(MODEL_NAME).capabilities


@pytest.mark.slow
def test_a_real_coder_fills_the_hole():
    """On the real Qwen2.5-Coder GGUF: a suffix gives what the prompt spelled with its FIM
    tokens by hand gives, on this machine (the same engine's own output, not a text seen on
    one CPU)."""
    from tests.utils.qwen_coder import assemble

    path = assemble()
    if path is None:
        pytest.skip("Qwen2.5-Coder's packages are not installed (tests/utils/qwen_coder.py)")
    server = RemoteServer([str(path), "--served-model-name", FIM_NAME, "--max-model-len", "512"])
    spelled = f"<|fim_prefix|>{PREFIX}<|fim_suffix|>{SUFFIX}<|fim_middle|>"
    try:
        status, filled = complete(server, prompt=PREFIX, suffix=SUFFIX, max_tokens=24,
                                  ignore_eos=True)  # fmt: skip
        assert status == 200, filled
        status, by_hand = complete(server, prompt=spelled, max_tokens=24, ignore_eos=True)
        assert status == 200, by_hand
    finally:
        server.stop()
    assert filled["choices"][0]["text"] == by_hand["choices"][0]["text"]
    assert filled["usage"] == by_hand["usage"] and filled["usage"]["completion_tokens"] == 24
