"""POST /v1/embeddings on `minivllm serve --runner pooling`, through the official openai
client and raw HTTP: embeddings equal HF transformers' (the last token's hidden state, or
the mean, L2-normalized), base64 and float encodings, token-id and chat inputs, matryoshka
dimensions, every bad input a 4xx, and each API refused on the runner that lacks it. The
handler's concurrency and cancellation are checked in-process, with a fake engine."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
from types import SimpleNamespace

import numpy as np
import openai
import pytest
import torch

from tests.conftest import write_tiny_checkpoint
from tests.entrypoints.openai.conftest import MODEL_NAME
from tests.entrypoints.openai.utils import RemoteServer, post_json

pytestmark = pytest.mark.e2e

EMBED_NAME = "tiny-embed"
MAX_MODEL_LEN = 64
TEXTS = ["Hello world", "The capital of France is Paris.", "def add(a, b): return a + b"]
# Over 16 tokens: chunked over several steps on the matryoshka server.
LONG_TEXT = "The quick brown fox jumps over the lazy dog while the cat watches from the old fence."
ATOL = 1e-5


# ---------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, smollm2_tokenizer) -> str:
    """A tiny random Qwen3ForCausalLM, served with --runner pooling."""
    folder = tmp_path_factory.mktemp("tiny-embed")
    return write_tiny_checkpoint("qwen3", str(folder), smollm2_tokenizer)


@pytest.fixture(scope="module")
def matryoshka_checkpoint(checkpoint, tmp_path_factory) -> str:
    """The same weights, their config saying the embeddings may be cut (is_matryoshka)."""
    folder = str(tmp_path_factory.mktemp("tiny-matryoshka") / "model")
    shutil.copytree(checkpoint, folder)
    config_file = os.path.join(folder, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    config["is_matryoshka"] = True
    with open(config_file, "w") as f:
        json.dump(config, f)
    return folder


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    import transformers

    return transformers.AutoModel.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hidden_states(hf_model):
    """The reference: HF's final hidden states (float32) of a token id list."""

    def compute(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return hf_model(torch.tensor([ids])).last_hidden_state[0]

    return compute


@pytest.fixture(scope="module")
def embed_server(checkpoint):
    remote = RemoteServer(
        [
            checkpoint, "--runner", "pooling", "--served-model-name", EMBED_NAME,
            "--max-model-len", str(MAX_MODEL_LEN), "--dtype", "float32",
        ]
    )  # fmt: skip
    yield remote
    remote.stop()


@pytest.fixture(scope="module")
def embed_client(embed_server):
    return embed_server.get_client()


@pytest.fixture(scope="module")
def matryoshka_server(matryoshka_checkpoint):
    """vLLM's other spellings of the runner (--convert embed), MEAN pooling, and prompts
    chunked over several steps (16 tokens a step)."""
    remote = RemoteServer(
        [
            matryoshka_checkpoint, "--convert", "embed", "--served-model-name", EMBED_NAME,
            "--pooler-config", '{"pooling_type": "MEAN"}',
            "--max-model-len", str(MAX_MODEL_LEN), "--dtype", "float32",
            "--max-num-batched-tokens", "16", "--max-num-seqs", "4",
        ]
    )  # fmt: skip
    yield remote
    remote.stop()


def last_normalized(hidden: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(hidden[-1], dim=0)


def embeddings(server, body: dict) -> tuple[int, dict]:
    return post_json(server.url_for("v1", "embeddings"), {"model": EMBED_NAME, **body})


def assert_close(got, expected: torch.Tensor) -> None:
    got = torch.tensor(got, dtype=torch.float32)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def assert_error(status: int, body: dict, code: int, *, param=None, says: str = "") -> None:
    assert status == code, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code
    assert says.lower() in error["message"].lower()
    if param is not None:
        assert error["param"] == param


# ---------------------------------------------------------------------------- the pooling server


def test_openai_client_embeddings_equal_hf(embed_client, smollm2_tokenizer, hidden_states):
    """The client asks for base64 by default and decodes it: the float32 values survive."""
    response = embed_client.embeddings.create(model=EMBED_NAME, input=TEXTS)
    assert response.model == EMBED_NAME and response.object == "list"
    assert [d.index for d in response.data] == list(range(len(TEXTS)))
    all_ids = [smollm2_tokenizer.encode(text) for text in TEXTS]
    for ids, item in zip(all_ids, response.data):
        assert item.object == "embedding"
        assert_close(item.embedding, last_normalized(hidden_states(ids)))
    num_tokens = sum(len(ids) for ids in all_ids)
    assert (response.usage.prompt_tokens, response.usage.total_tokens) == (num_tokens, num_tokens)


def test_ollama_client_embed_equals_the_embeddings_route(embed_server):
    """Ollama's /api/embed through its own client: the vectors /v1/embeddings gives."""
    import ollama

    reply = ollama.Client(host=embed_server.url_root).embed(model=EMBED_NAME, input=TEXTS)
    status, body = embeddings(embed_server, {"input": TEXTS, "encoding_format": "float"})
    assert status == 200, body
    assert len(reply.embeddings) == len(TEXTS)
    for got, item in zip(reply.embeddings, body["data"], strict=True):
        np.testing.assert_allclose(got, item["embedding"], atol=1e-6, rtol=0)
    assert reply.prompt_eval_count == body["usage"]["prompt_tokens"]


def test_ollama_cuts_a_long_input_to_its_first_tokens(embed_server, smollm2_tokenizer):
    """Ollama's truncate (true by default): a text past the context keeps its first tokens,
    as Ollama cuts it; truncate false is Ollama's 400. An empty input only loads."""
    import ollama

    client = ollama.Client(host=embed_server.url_root)
    long_text = " ".join([LONG_TEXT] * 5)
    ids = smollm2_tokenizer.encode(long_text)
    assert len(ids) > MAX_MODEL_LEN
    reply = client.embed(model=EMBED_NAME, input=[long_text, TEXTS[0]])
    status, body = embeddings(embed_server, {"input": [ids[:MAX_MODEL_LEN]]})
    assert status == 200, body
    np.testing.assert_allclose(reply.embeddings[0], body["data"][0]["embedding"], atol=1e-6)
    assert reply.prompt_eval_count == MAX_MODEL_LEN + len(smollm2_tokenizer.encode(TEXTS[0]))
    with pytest.raises(ollama.ResponseError) as info:
        client.embed(model=EMBED_NAME, input=long_text, truncate=False)
    assert info.value.status_code == 400 and "maximum context length" in info.value.error
    assert client.embed(model=EMBED_NAME, input=[]).embeddings == []


def test_ollama_legacy_embeddings_are_not_normalized(embed_server):
    """/api/embeddings (`ollama.embeddings()`): one prompt's vector as the model gives it,
    where /api/embed normalizes it, as Ollama's two routes do."""
    import ollama

    client = ollama.Client(host=embed_server.url_root)
    legacy = client.embeddings(model=EMBED_NAME, prompt=TEXTS[1]).embedding
    status, body = embeddings(embed_server, {"input": TEXTS[1], "normalize": False})
    assert status == 200, body
    np.testing.assert_allclose(legacy, body["data"][0]["embedding"], atol=1e-6)
    assert abs(np.linalg.norm(legacy) - 1) > 1e-3
    (normalized,) = client.embed(model=EMBED_NAME, input=TEXTS[1]).embeddings
    np.testing.assert_allclose(normalized, legacy / np.linalg.norm(legacy), atol=1e-6)
    assert client.embeddings(model=EMBED_NAME, prompt="").embedding == []


def test_float_encoding_json_shape(embed_server, embed_client, smollm2_tokenizer):
    status, body = embeddings(embed_server, {"input": TEXTS[:2], "encoding_format": "float"})
    assert status == 200, body
    assert set(body) == {"id", "object", "created", "model", "data", "usage"}
    assert body["id"].startswith("embd-") and body["object"] == "list"
    assert isinstance(body["created"], int) and body["model"] == EMBED_NAME
    num_tokens = sum(len(smollm2_tokenizer.encode(text)) for text in TEXTS[:2])
    assert body["usage"] == {
        "prompt_tokens": num_tokens,
        "total_tokens": num_tokens,
        "completion_tokens": 0,
    }
    for i, item in enumerate(body["data"]):
        assert set(item) == {"index", "object", "embedding"}
        assert (item["index"], item["object"]) == (i, "embedding")
        assert len(item["embedding"]) == 64 and all(isinstance(v, float) for v in item["embedding"])
        assert abs(np.linalg.norm(item["embedding"]) - 1) < 1e-5
    # The same vectors as base64 (decoded as OpenAI's client does).
    encoded = embed_client.embeddings.create(model=EMBED_NAME, input=TEXTS[:2])
    for item, other in zip(body["data"], encoded.data):
        np.testing.assert_allclose(item["embedding"], other.embedding, atol=1e-6)


def test_base64_is_little_endian_float32_and_embed_dtype(embed_server):
    status, as_floats = embeddings(embed_server, {"input": TEXTS[0], "encoding_format": "float"})
    assert status == 200
    expected = np.array(as_floats["data"][0]["embedding"], dtype=np.float32)
    for embed_dtype, numpy_type in (("float32", "<f4"), ("float16", "<f2"), (None, "<f4")):
        body = {"input": TEXTS[0], "encoding_format": "base64"}
        if embed_dtype is not None:
            body["embed_dtype"] = embed_dtype
        status, response = embeddings(embed_server, body)
        assert status == 200, response
        raw = base64.b64decode(response["data"][0]["embedding"])
        values = np.frombuffer(raw, dtype=numpy_type).astype(np.float32)
        np.testing.assert_allclose(values, expected, atol=1e-3 if numpy_type == "<f2" else 0)


def test_token_id_inputs(embed_server, embed_client, hidden_states):
    ids = [[504, 3575, 282, 4649, 314], [19556, 905], [1, 2, 3, 4, 5, 6, 7]]
    response = embed_client.embeddings.create(model=EMBED_NAME, input=ids)
    for prompt, item in zip(ids, response.data):
        assert_close(item.embedding, last_normalized(hidden_states(prompt)))
    assert response.usage.prompt_tokens == sum(len(p) for p in ids)
    status, body = embeddings(embed_server, {"input": ids[0], "encoding_format": "float"})
    assert status == 200 and len(body["data"]) == 1 and body["usage"]["prompt_tokens"] == 5
    assert_close(body["data"][0]["embedding"], last_normalized(hidden_states(ids[0])))


def test_a_batch_equals_each_prompt_alone(embed_server):
    """The prompts of one request run at once in the engine: the same vectors as alone."""
    prompts = [f"Sentence number {i} is about {'cats' if i % 2 else 'dogs'}." for i in range(12)]
    status, batch = embeddings(embed_server, {"input": prompts, "encoding_format": "float"})
    assert status == 200
    for prompt, item in zip(prompts, batch["data"]):
        status, alone = embeddings(embed_server, {"input": prompt, "encoding_format": "float"})
        assert status == 200
        assert_close(item["embedding"], torch.tensor(alone["data"][0]["embedding"]))


def test_normalize_false_gives_the_hidden_state(embed_server, smollm2_tokenizer, hidden_states):
    body = {"input": TEXTS[1], "encoding_format": "float", "normalize": False}
    status, response = embeddings(embed_server, body)
    assert status == 200, response
    expected = hidden_states(smollm2_tokenizer.encode(TEXTS[1]))[-1]
    assert_close(response["data"][0]["embedding"], expected)


def test_truncate_prompt_tokens(embed_server, smollm2_tokenizer, hidden_states):
    long_text = " ".join(["word"] * (MAX_MODEL_LEN + 20))
    ids = smollm2_tokenizer.encode(long_text)
    assert len(ids) > MAX_MODEL_LEN
    status, error = embeddings(embed_server, {"input": long_text})
    assert_error(status, error, 400, param="input", says="maximum context length is 64")
    status, error = embeddings(embed_server, {"input": ids})
    assert_error(status, error, 400, param="input", says="maximum context length")
    for truncate, kept in ((10, 10), (-1, MAX_MODEL_LEN)):
        body = {"input": long_text, "encoding_format": "float", "truncate_prompt_tokens": truncate}
        status, response = embeddings(embed_server, body)
        assert status == 200, response
        assert response["usage"]["prompt_tokens"] == kept
        expected = last_normalized(hidden_states(ids[-kept:]))  # the end is kept, as vLLM
        assert_close(response["data"][0]["embedding"], expected)


def test_chat_messages_form(embed_server, smollm2_tokenizer, hidden_states):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    status, response = embeddings(embed_server, {"messages": messages, "encoding_format": "float"})
    assert status == 200, response
    text = smollm2_tokenizer.apply_chat_template(messages, tokenize=False)
    ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
    assert response["usage"]["prompt_tokens"] == len(ids)
    assert_close(response["data"][0]["embedding"], last_normalized(hidden_states(ids)))


BAD_REQUESTS = [
    ({"input": []}, "input", "empty list"),
    ({"input": ""}, "input", "empty string"),
    ({"input": ["a", ""]}, "input", "empty string"),
    ({"input": [[1, 2], []]}, "input", "empty token list"),
    ({"input": 5}, "input", "must be a string"),
    ({"input": [True, False]}, "input", "must be a string"),
    ({"input": ["a", 1]}, "input", "must be a string"),
    ({"input": [1.5]}, "input", "must be a string"),
    ({"input": {"text": "a"}}, "input", "must be a string"),
    ({}, "input", "missing"),
    ({"input": [1, 2, 10_000_000]}, "input", "out of vocabulary"),
    ({"input": [-1]}, "input", "out of vocabulary"),
    ({"input": "a", "dimensions": 8}, "dimensions", "does not support matryoshka"),
    ({"input": "a", "dimensions": 0}, "dimensions", ""),
    ({"input": "a", "encoding_format": "hex"}, "encoding_format", ""),
    ({"input": "a", "embed_dtype": "int8"}, "embed_dtype", ""),
    ({"input": "a", "normalize": "yes"}, "normalize", ""),
    ({"input": "a", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "at least 1"),
    ({"input": "a", "truncate_prompt_tokens": 65}, "truncate_prompt_tokens", "max_model_len"),
    ({"input": "a", "priority": 1}, "priority", "priority scheduling is not enabled"),
    ({"input": "\ud800"}, None, "not valid UTF-8"),
    ({"messages": []}, "messages", ""),
    ({"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ x }}"}, None, ""),
]


@pytest.mark.parametrize("body, param, says", BAD_REQUESTS)
def test_bad_requests_are_400(embed_server, body, param, says):
    status, error = embeddings(embed_server, body)
    assert_error(status, error, 400, param=param, says=says)


def test_other_client_errors(embed_server, embed_client):
    status, error = post_json(
        embed_server.url_for("v1", "embeddings"), {"model": "other", "input": "a"}
    )
    assert_error(status, error, 404, param="model", says="does not exist")
    status, error = post_json(embed_server.url_for("v1", "embeddings"), ["a"])
    assert_error(status, error, 400, says="JSON object")
    with pytest.raises(openai.BadRequestError, match="does not support matryoshka"):
        embed_client.embeddings.create(model=EMBED_NAME, input="a", dimensions=8)


def test_generation_apis_are_refused(embed_server, embed_client):
    with pytest.raises(openai.BadRequestError, match="does not support Completions API"):
        embed_client.completions.create(model=EMBED_NAME, prompt="Hello")
    with pytest.raises(openai.BadRequestError, match="does not support Chat Completions API"):
        embed_client.chat.completions.create(
            model=EMBED_NAME, messages=[{"role": "user", "content": "Hello"}]
        )
    assert [m.id for m in embed_client.models.list().data] == [EMBED_NAME]


def test_the_server_still_serves_after_the_errors(embed_client, smollm2_tokenizer, hidden_states):
    response = embed_client.embeddings.create(model=EMBED_NAME, input=TEXTS[0])
    expected = last_normalized(hidden_states(smollm2_tokenizer.encode(TEXTS[0])))
    assert_close(response.data[0].embedding, expected)


# ---------------------------------------------------------------------------- matryoshka, MEAN


def test_mean_pooling_and_dimensions(matryoshka_server, smollm2_tokenizer, hidden_states):
    client = matryoshka_server.get_client()
    texts = [LONG_TEXT, TEXTS[0]]
    means = [hidden_states(smollm2_tokenizer.encode(t)).mean(0) for t in texts]
    assert len(smollm2_tokenizer.encode(LONG_TEXT)) > 16  # chunked
    full = client.embeddings.create(model=EMBED_NAME, input=texts)
    for item, mean in zip(full.data, means):
        assert_close(item.embedding, torch.nn.functional.normalize(mean, dim=0))
    cut = client.embeddings.create(model=EMBED_NAME, input=texts, dimensions=16)
    for item, mean in zip(cut.data, means):
        assert_close(item.embedding, torch.nn.functional.normalize(mean[:16], dim=0))
    status, error = embeddings(matryoshka_server, {"input": "a", "dimensions": 65})
    assert_error(status, error, 400, param="dimensions", says="hidden size 64")


# ---------------------------------------------------------------------------- a generative server


def test_embeddings_refused_on_a_generative_model(server, client):
    with pytest.raises(openai.BadRequestError, match="does not support Embeddings API"):
        client.embeddings.create(model=MODEL_NAME, input="Hello")
    status, error = post_json(server.url_for("v1", "embeddings"), {"input": "Hello"})
    assert_error(status, error, 400, says="The model does not support Embeddings API")
    assert client.models.list().data[0].id == MODEL_NAME


# ---------------------------------------------------------------------------- in-process


class FakeProcessor:
    """The Processor's contract: a checked prompt becomes one engine request."""

    def validate_prompt_ids(self, ids: list[int]) -> None:
        pass

    def process_inputs(self, request_id, prompt, params, arrival_time=None, **kwargs):
        ids = prompt["prompt_token_ids"]
        request = SimpleNamespace(
            request_id=request_id, prompt_token_ids=ids, pooling_params=params
        )
        return prompt.get("prompt"), request


class FakeEngine:
    """AsyncLLM.encode's contract: one output per prompt; a stream closed early aborts.
    Every stream waits until all the request's prompts have started (so they must run at
    once); a prompt whose first token is 13 fails in the engine ("error")."""

    errored = False
    processor = FakeProcessor()

    def __init__(self, num_prompts: int, hang: bool = False) -> None:
        self.all_started = asyncio.Event()
        self.num_prompts = num_prompts
        self.hang = hang
        self.started: list[str] = []
        self.aborted: list[str] = []

    async def encode(self, request, params, request_id, *, prompt_text=None, **kwargs):
        from minivllm.outputs import PoolingOutput, PoolingRequestOutput

        self.started.append(request_id)
        if len(self.started) == self.num_prompts:
            self.all_started.set()
        try:
            await self.all_started.wait()
            if self.hang:
                await asyncio.Event().wait()
            ids = request.prompt_token_ids
            error = ids[0] == 13
            yield PoolingRequestOutput(
                request_id=request_id,
                outputs=PoolingOutput(torch.tensor([] if error else [float(len(ids))] * 4)),
                prompt_token_ids=ids,
                finished=True,
                finish_reason="error" if error else "stop",
            )
        except (GeneratorExit, asyncio.CancelledError):
            self.aborted.append(request_id)
            raise


def fake_handler(engine: FakeEngine, tokenizer):
    from minivllm.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
    from minivllm.entrypoints.openai.serving_models import ServedModels

    model_config = SimpleNamespace(
        is_matryoshka=False,
        pooling_task="embed",
        pooling_tasks=("embed",),
        hf_config=SimpleNamespace(hidden_size=4),
    )
    return OpenAIServingEmbedding(
        engine=engine,
        tokenizer=tokenizer,
        models=ServedModels(["fake"], "fake", MAX_MODEL_LEN),
        model_config=model_config,
    )


def test_prompts_run_at_once_and_a_failure_is_a_500(smollm2_tokenizer):
    from minivllm.entrypoints.openai.errors import InternalServerError
    from minivllm.entrypoints.openai.protocol import EmbeddingCompletionRequest

    async def run(inputs, engine):
        request = EmbeddingCompletionRequest(input=inputs, encoding_format="float")
        return await fake_handler(engine, smollm2_tokenizer).create_embedding(request)

    inputs = [[1] * n for n in range(1, 9)]
    engine = FakeEngine(len(inputs))  # would wait forever if they ran one by one
    response = asyncio.run(asyncio.wait_for(run(inputs, engine), 10))
    data = json.loads(response.body)["data"]
    assert [d["embedding"] for d in data] == [[float(n)] * 4 for n in range(1, 9)]
    assert engine.aborted == []

    failing = [[1, 2], [13, 2], [1, 2, 3]]
    with pytest.raises(InternalServerError) as info:
        asyncio.run(asyncio.wait_for(run(failing, FakeEngine(len(failing))), 10))
    assert info.value.status == 500 and "failed in the engine" in info.value.message


def test_cancelling_the_request_aborts_every_prompt(smollm2_tokenizer):
    """What run_unless_disconnected does when the client goes away."""
    from minivllm.entrypoints.openai.protocol import EmbeddingCompletionRequest

    engine = FakeEngine(num_prompts=5, hang=True)

    async def run():
        request = EmbeddingCompletionRequest(input=[[1, 2]] * 5)
        task = asyncio.ensure_future(
            fake_handler(engine, smollm2_tokenizer).create_embedding(request)
        )
        await asyncio.wait_for(engine.all_started.wait(), 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    assert sorted(engine.aborted) == sorted(engine.started) and len(engine.started) == 5
