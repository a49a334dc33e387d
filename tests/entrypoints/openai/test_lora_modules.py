"""`minivllm serve --enable-lora --lora-modules ...`, driven by the openai client: each
adapter is a model of its own in /v1/models and in requests, whose greedy completions equal
HF transformers' on the base weights with the adapter merged; a bad adapter stops the
start-up."""

from __future__ import annotations

import json

import openai
import pytest
import torch

from tests.conftest import write_tiny_checkpoint
from tests.entrypoints.openai.utils import RemoteServer, metrics, post_json, request
from tests.lora.conftest import merge_adapter, write_adapter
from tests.model.test_hf_parity import hf_greedy

pytestmark = pytest.mark.e2e

PROMPT = "The capital of France is"
MAX_NEW = 10


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, smollm2_tokenizer):
    root = tmp_path_factory.mktemp("serve-lora")
    base = write_tiny_checkpoint("qwen3", str(root / "base"), smollm2_tokenizer)
    first = write_adapter(base, str(root / "first"), seed=1)
    second = write_adapter(base, str(root / "second"), seed=2, rank=4)
    return base, first, second


@pytest.fixture(scope="module")
def lora_server(checkpoints):
    base, first, second = checkpoints
    remote = RemoteServer(
        [
            base, "--served-model-name", "base", "--dtype", "float32", "--max-model-len", "128",
            "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
            "--lora-modules", f"first={first}",
            json.dumps({"name": "second", "path": second, "base_model_name": "base"}),
        ],
        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"},
    )  # fmt: skip
    yield remote
    remote.stop()


def expected_text(folder: str, tokenizer) -> str:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = hf_greedy(model.eval(), tokenizer.encode(PROMPT), MAX_NEW, None)
    return tokenizer.decode(ids)


def test_each_adapter_is_a_model(lora_server, checkpoints, smollm2_tokenizer):
    base, first, second = checkpoints
    client = openai.OpenAI(base_url=lora_server.url_for("v1"), api_key="none")
    cards = {card.id: card for card in client.models.list().data}
    assert sorted(cards) == ["base", "first", "second"]
    assert cards["first"].root == first and cards["first"].parent == "base"
    assert cards["second"].parent == "base"
    for name, folder in [
        ("base", base),
        ("first", merge_adapter(base, first, first + "-merged")),
        ("second", merge_adapter(base, second, second + "-merged")),
    ]:
        completion = client.completions.create(
            model=name,
            prompt=PROMPT,
            max_tokens=MAX_NEW,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert completion.model == name
        assert completion.choices[0].text == expected_text(folder, smollm2_tokenizer), name
    chat = client.chat.completions.create(
        model="second", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert chat.model == "second" and chat.usage.completion_tokens >= 1
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="third", prompt=PROMPT, max_tokens=2)

    # vLLM's vllm:lora_requests_info (the adapters running and waiting, by name; which
    # names a running request gives is tests/metrics' and tests/core's to show): all done.
    series = {k: v for k, v in metrics(lora_server).items() if "lora_requests_info" in k}
    newest = max(series, key=series.get)
    assert newest == (
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}'
    )


def test_a_bad_adapter_stops_the_start_up(checkpoints, tmp_path, smollm2_tokenizer):
    base, first, _ = checkpoints
    with pytest.raises(RuntimeError, match="greater than max_lora_rank 4"):
        RemoteServer(
            [base, "--enable-lora", "--max-lora-rank", "4", "--lora-modules", f"a={first}"]
        )
    other = write_tiny_checkpoint(
        "qwen3", str(tmp_path / "other"), smollm2_tokenizer, hidden_size=32
    )
    wrong = write_adapter(other, str(tmp_path / "wrong"), seed=0)
    with pytest.raises(RuntimeError, match="an adapter of another model"):
        RemoteServer([base, "--enable-lora", "--lora-modules", f"wrong={wrong}"])
    with pytest.raises(RuntimeError, match="--lora-modules needs --enable-lora"):
        RemoteServer([base, "--lora-modules", f"a={first}"])


def test_adapters_load_and_unload_at_run_time(lora_server, checkpoints, tmp_path):
    base, first, _ = checkpoints
    client = openai.OpenAI(base_url=lora_server.url_for("v1"), api_key="none")
    load = lora_server.url_for("v1", "load_lora_adapter")
    unload = lora_server.url_for("v1", "unload_lora_adapter")
    status, _, body = request("POST", load, {"lora_name": "again", "lora_path": first})
    assert status == 200 and body.decode() == "Success: LoRA adapter 'again' added successfully."
    assert "again" in {card.id for card in client.models.list().data}
    # The same weights as `first` under another name and id: the same tokens.
    texts = [
        client.completions.create(model=name, prompt=PROMPT, max_tokens=MAX_NEW, temperature=0)
        .choices[0]
        .text
        for name in ("first", "again")
    ]
    assert texts[0] == texts[1]
    status, error = post_json(load, {"lora_name": "again", "lora_path": first})
    assert status == 400 and "has already been loaded" in error["error"]["message"]
    status, error = post_json(load, {"lora_name": "nowhere", "lora_path": str(tmp_path)})
    assert status == 400 and "No adapter found" in error["error"]["message"]
    # Names and paths are checked: 400s, never a 500 (issue 47).
    for bad in (
        {"lora_name": "empty-path", "lora_path": ""},
        {"lora_name": "blank-path", "lora_path": "   "},
        {"lora_name": "", "lora_path": first},
        {"lora_name": "has space", "lora_path": first},
        {"lora_name": "x" * 300, "lora_path": first},
        {"lora_name": "file", "lora_path": str(tmp_path / "missing" / "adapter")},
    ):
        status, error = post_json(load, bad)
        assert status == 400, (bad, error)
    status, _, body = request("POST", unload, {"lora_name": "again"})
    assert status == 200 and "removed successfully" in body.decode()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="again", prompt=PROMPT, max_tokens=2)
    status, error = post_json(unload, {"lora_name": "again"})
    assert status == 404 and "cannot be found" in error["error"]["message"]


def test_run_time_loading_is_off_by_default(checkpoints):
    base, first, _ = checkpoints
    remote = RemoteServer([base, "--enable-lora", "--max-model-len", "64"])
    try:
        url = remote.url_for("v1", "load_lora_adapter")
        status, _ = post_json(url, {"lora_name": "a", "lora_path": first})
        assert status == 404
    finally:
        remote.stop()
