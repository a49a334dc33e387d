"""Issue 52's model set on one many-model server: the bundled GGUF, a tiny second
generative model, an embedding model and a tiny reranker in one folder, asked in turn and
at once, each answering as it does alone (the tiny ones checked against HF transformers);
and what a many-model server answers about a model without serving a request for it
(Ollama's /api/show from its config, /tokenizer_info for the model the query names,
/health)."""

from __future__ import annotations

import concurrent.futures
import json
import os

import pytest
import torch

from tests.conftest import write_tiny_checkpoint
from tests.entrypoints.openai.utils import RemoteServer, request
from tests.entrypoints.test_llm_classify import hf_logits, write_cross_encoder

pytestmark = pytest.mark.e2e

ENV = {"MINIVLLM_CPU_KVCACHE_SPACE": "0.05"}
PROMPT_IDS = [1, 504, 3458, 282, 4649, 314]  # a fixed prompt for the tiny model
QUERY = "What is the capital of France?"
DOCUMENTS = ["The capital of Brazil is Brasilia.", "Paris is the capital of France.", "def f()"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory, smollm2_path, smollm2_tokenizer) -> str:
    root = tmp_path_factory.mktemp("model-set")
    os.symlink(smollm2_path, root / "smollm2.gguf")
    write_tiny_checkpoint("llama", str(root / "tiny"), smollm2_tokenizer)
    embedder = write_tiny_checkpoint("qwen3", str(root / "embedder"), smollm2_tokenizer)
    with open(os.path.join(embedder, "config.json")) as f:
        config = json.load(f)
    config["architectures"] = ["Qwen3Model"]  # a bare model: the pooling runner embeds
    with open(os.path.join(embedder, "config.json"), "w") as f:
        json.dump(config, f)
    # Its writer leaves a generative sibling folder beside it: written elsewhere, linked here.
    elsewhere = tmp_path_factory.mktemp("reranker")
    os.symlink(write_cross_encoder("llama", str(elsewhere / "model"), smollm2_tokenizer),
               root / "reranker")  # fmt: skip
    return str(root)


@pytest.fixture(scope="module")
def server(folder):
    args = ["--models-dir", folder, "--max-model-len", "512", "--disable-log-stats",
            "--enable-tokenizer-info-endpoint"]  # fmt: skip
    remote = RemoteServer(args, env=ENV)
    yield remote
    remote.stop()


def _post(server: RemoteServer, path: str, body: dict) -> tuple[int, dict]:
    status, _, data = request("POST", server.url_for(path), body, timeout=300)
    return status, json.loads(data) if data else {}


def _get(server: RemoteServer, path: str) -> tuple[int, dict]:
    status, _, data = request("GET", server.url_for(path), timeout=300)
    return status, json.loads(data) if data else {}


def _states(server: RemoteServer) -> dict[str, str]:
    return {card["id"]: card["state"] for card in _get(server, "v1/models")[1]["data"]}


def test_show_and_health_answer_without_starting_a_model(server):
    assert set(_states(server)) == {"smollm2", "tiny", "embedder", "reranker"}
    status, body = _post(server, "api/show", {"model": "embedder"})
    assert status == 200, body
    assert body["capabilities"] == ["embedding"]
    assert body["details"]["format"] == "safetensors"
    assert body["model_info"]["general.architecture"] == body["details"]["family"] == "qwen3"
    assert body["model_info"]["qwen3.context_length"] > 0
    status, body = _post(server, "api/show", {"model": "smollm2"})
    assert status == 200, body
    assert body["capabilities"] == ["completion"] and body["details"]["format"] == "gguf"
    assert body["details"]["family"] == "llama"  # the GGUF's architecture, as Ollama's
    status, body = _post(server, "api/show", {"model": "nope"})
    assert status == 404 and "does not exist" in body["error"]
    status, body = _get(server, "health")
    assert status == 200 and body["status"] == "ok"
    assert set(_states(server).values()) == {"unloaded"}  # nothing was started


def _tiny_completion(server: RemoteServer) -> list[int]:
    status, body = _post(
        server,
        "v1/completions",
        {"model": "tiny", "prompt": PROMPT_IDS, "max_tokens": 8, "temperature": 0,
         "ignore_eos": True, "logprobs": 1, "return_tokens_as_token_ids": True},
    )  # fmt: skip
    assert status == 200, body
    return [int(t.split(":")[1]) for t in body["choices"][0]["logprobs"]["tokens"]]


def _chat(server: RemoteServer) -> str:
    status, body = _post(
        server,
        "v1/chat/completions",
        {"model": "smollm2", "messages": [{"role": "user", "content": "What is 2+2?"}],
         "max_tokens": 8, "temperature": 0},
    )  # fmt: skip
    assert status == 200, body
    return body["choices"][0]["message"]["content"]


def _embed(server: RemoteServer) -> list[float]:
    status, body = _post(server, "v1/embeddings", {"model": "embedder", "input": "hello"})
    assert status == 200, body
    return body["data"][0]["embedding"]


def _rerank(server: RemoteServer) -> dict[int, float]:
    status, body = _post(
        server,
        "v1/rerank",
        {"model": "reranker", "query": QUERY, "documents": DOCUMENTS, "use_activation": False},
    )
    assert status == 200, body
    return {r["index"]: r["relevance_score"] for r in body["results"]}


def test_each_model_answers_its_own_way_interleaved(server, folder, smollm2_tokenizer):
    import transformers

    tiny = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.join(folder, "tiny"), dtype=torch.float32
    ).eval()
    with torch.no_grad():
        expected = tiny.generate(
            torch.tensor([PROMPT_IDS]), max_new_tokens=8, do_sample=False, min_new_tokens=8
        )[0, len(PROMPT_IDS) :].tolist()
    reranker = os.path.join(folder, "reranker")
    pair_tokenizer = transformers.AutoTokenizer.from_pretrained(reranker)
    logits = {
        i: hf_logits(reranker, pair_tokenizer(QUERY, text_pair=d)["input_ids"])[0].item()
        for i, d in enumerate(DOCUMENTS)
    }

    # In turn: each model's first request starts its engine core beside the others.
    assert _tiny_completion(server) == expected
    chat = _chat(server)
    assert chat.strip()
    embedding = _embed(server)
    assert len(embedding) == 64 and sum(x * x for x in embedding) == pytest.approx(1, abs=1e-3)
    assert _rerank(server) == pytest.approx(logits, abs=1e-3)
    assert set(_states(server).values()) == {"loaded"}

    # At once, interleaved: the same answers.
    calls = [_tiny_completion, _chat, _embed, _rerank] * 2
    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        results = list(pool.map(lambda call: call(server), calls))
    for call, result in zip(calls, results):
        if call is _tiny_completion:
            assert result == expected
        elif call is _chat:
            assert result == chat
        elif call is _embed:
            assert result == pytest.approx(embedding, abs=1e-5)
        else:
            assert result == pytest.approx(logits, abs=1e-3)


def test_tokenizer_info_answers_for_the_model_the_query_names(server):
    status, body = _get(server, "tokenizer_info?model=tiny")
    assert status == 200, body
    assert body["tokenizer_class"]
    status, body = _get(server, "tokenizer_info")
    assert status == 400 and "`model` is required" in body["error"]["message"]
    status, body = _get(server, "tokenizer_info?model=nope")
    assert status == 404


def test_show_of_a_loaded_model_answers_from_it(server):
    _chat(server)
    status, body = _post(server, "api/show", {"model": "smollm2"})
    assert status == 200, body
    assert body["capabilities"] == ["completion"] and body["details"]["family"] == "llama"
