"""POST /score and /rerank on `minivllm serve --runner pooling`, over raw HTTP: each pair's
score is the cosine of HF transformers' embeddings of its two texts (the last token's
hidden state), vLLM's response shapes and paths, every bad input a 400, and both APIs refused
on a generative model; with a cross-encoder, HF's activated logit over the pair's encoding."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import write_tiny_checkpoint
from tests.entrypoints.openai.utils import RemoteServer, post_json
from tests.entrypoints.test_llm_classify import hf_logits, write_cross_encoder

pytestmark = pytest.mark.e2e

NAME = "tiny-embed"
QUERY = "What is the capital of France?"
DOCUMENTS = ["The capital of Brazil is Brasilia.", "Paris is in France.", "def f(): pass"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, smollm2_tokenizer) -> str:
    folder = tmp_path_factory.mktemp("tiny-score")
    return write_tiny_checkpoint("qwen3", str(folder), smollm2_tokenizer)


@pytest.fixture(scope="module")
def score_server(checkpoint):
    remote = RemoteServer(
        [
            checkpoint, "--runner", "pooling", "--served-model-name", NAME,
            "--max-model-len", "64", "--dtype", "float32",
        ]
    )  # fmt: skip
    yield remote
    remote.stop()


@pytest.fixture(scope="module")
def cosine(checkpoint, smollm2_tokenizer):
    """The reference: the cosine of HF's last hidden states of two texts."""
    import transformers

    model = transformers.AutoModel.from_pretrained(checkpoint, dtype=torch.float32).eval()

    def last_hidden(text: str) -> torch.Tensor:
        with torch.no_grad():
            ids = torch.tensor([smollm2_tokenizer.encode(text)])
            return model(ids).last_hidden_state[0, -1]

    def compute(first: str, second: str) -> float:
        return torch.cosine_similarity(last_hidden(first), last_hidden(second), dim=0).item()

    return compute


def num_tokens(tokenizer, *texts: str) -> int:
    return sum(len(tokenizer.encode(t)) for t in texts)


@pytest.mark.parametrize("path", [("score",), ("v1", "score")])
def test_score_one_against_many_and_pairwise(score_server, cosine, smollm2_tokenizer, path):
    status, body = post_json(
        score_server.url_for(*path), {"model": NAME, "text_1": QUERY, "text_2": DOCUMENTS}
    )
    assert status == 200, body
    assert body["id"].startswith("score-") and body["object"] == "list"
    assert body["model"] == NAME
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    assert {d["object"] for d in body["data"]} == {"score"}
    scores = [d["score"] for d in body["data"]]
    assert scores == pytest.approx([cosine(QUERY, d) for d in DOCUMENTS], abs=1e-5)
    assert len(set(scores)) == 3
    expected_tokens = sum(num_tokens(smollm2_tokenizer, QUERY, d) for d in DOCUMENTS)
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] == expected_tokens

    pairs = {"text_1": [QUERY, DOCUMENTS[2]], "text_2": DOCUMENTS[:2]}
    status, body = post_json(score_server.url_for(*path), pairs)  # no model: the served one
    assert status == 200, body
    expected = [cosine(QUERY, DOCUMENTS[0]), cosine(DOCUMENTS[2], DOCUMENTS[1])]
    assert [d["score"] for d in body["data"]] == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("path", [("rerank",), ("v1", "rerank"), ("v2", "rerank")])
def test_rerank_orders_the_documents(score_server, cosine, smollm2_tokenizer, path):
    url = score_server.url_for(*path)
    status, body = post_json(url, {"model": NAME, "query": QUERY, "documents": DOCUMENTS})
    assert status == 200, body
    assert body["id"].startswith("rerank-") and body["model"] == NAME
    expected = {i: cosine(QUERY, d) for i, d in enumerate(DOCUMENTS)}
    order = sorted(expected, key=expected.get, reverse=True)
    assert [r["index"] for r in body["results"]] == order
    for result in body["results"]:
        assert result["relevance_score"] == pytest.approx(expected[result["index"]], abs=1e-5)
        assert result["document"] == {"text": DOCUMENTS[result["index"]]}
    assert body["usage"] == {
        "total_tokens": sum(num_tokens(smollm2_tokenizer, QUERY, d) for d in DOCUMENTS)
    }

    status, body = post_json(
        url, {"query": QUERY, "documents": DOCUMENTS, "top_n": 2, "return_documents": False}
    )
    assert status == 200, body
    assert [r["index"] for r in body["results"]] == order[:2]
    assert all(r["document"] is None for r in body["results"])


BAD_REQUESTS = [
    ("score", {"text_1": [QUERY, QUERY], "text_2": DOCUMENTS}, "text_1", "1:1, 1:N or N:N"),
    ("score", {"text_1": [], "text_2": DOCUMENTS}, "text_1", "empty list"),
    ("score", {"text_1": QUERY, "text_2": ["a", ""]}, "text_2", "empty string"),
    ("score", {"text_1": QUERY}, "text_2", "missing"),
    ("score", {"text_1": 5, "text_2": "a"}, "text_1", ""),
    ("score", {"text_1": "a", "text_2": "b", "priority": 1}, "priority", "not enabled"),
    ("score", {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 0}, None, "at least 1"),
    ("score", {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 65}, None, "max_model_len"),
    ("score", {"text_1": "a " * 200, "text_2": "b"}, "text_1", "maximum context length"),
    ("rerank", {"query": QUERY, "documents": []}, "documents", "empty list"),
    ("rerank", {"query": "", "documents": DOCUMENTS}, "query", "empty string"),
    ("rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": -1}, "top_n", ""),
    ("rerank", {"documents": DOCUMENTS}, "query", "missing"),
]


@pytest.mark.parametrize("path, body, param, says", BAD_REQUESTS)
def test_bad_requests_are_400(score_server, path, body, param, says):
    status, error = post_json(score_server.url_for(path), body)
    assert status == 400, error
    assert says.lower() in error["error"]["message"].lower()
    if param is not None:
        assert error["error"]["param"] == param


def test_unknown_model_is_404_and_the_server_goes_on(score_server, cosine):
    # The model is checked first: a body wrong in other ways too is still a 404.
    for path, body in [
        ("score", {"model": "other", "text_1": ["a", "b"], "text_2": ["c", "d", "e"]}),
        ("rerank", {"model": "other", "query": "a", "documents": ["b"]}),
    ]:
        status, error = post_json(score_server.url_for(path), body)
        assert status == 404 and error["error"]["param"] == "model"
    status, body = post_json(score_server.url_for("score"), {"text_1": "a", "text_2": "b"})
    assert status == 200 and body["data"][0]["score"] == pytest.approx(cosine("a", "b"), abs=1e-5)


def test_score_and_rerank_refused_on_a_generative_model(server):
    status, error = post_json(server.url_for("score"), {"text_1": "a", "text_2": "b"})
    assert status == 400 and "does not support Score API" in error["error"]["message"]
    status, error = post_json(server.url_for("v1", "rerank"), {"query": "a", "documents": ["b"]})
    assert status == 400 and "does not support Rerank API" in error["error"]["message"]


# ---------------------------------------------------------------------------- cross-encoder


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory, smollm2_tokenizer) -> str:
    folder = str(tmp_path_factory.mktemp("tiny-cross-encoder") / "model")
    return write_cross_encoder("llama", folder, smollm2_tokenizer)


@pytest.fixture(scope="module")
def cross_encoder_server(cross_encoder):
    remote = RemoteServer(
        [
            cross_encoder,
            "--served-model-name",
            "tiny-ce",
            "--max-model-len",
            "64",
            "--dtype",
            "float32",
        ]
    )
    yield remote
    remote.stop()


@pytest.fixture(scope="module")
def pair_logit(cross_encoder):
    """The reference: HF's logit of a pair, in the tokenizer's pair encoding; and its ids."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(cross_encoder)

    def compute(first: str, second: str) -> tuple[float, list[int]]:
        ids = tokenizer(first, text_pair=second)["input_ids"]
        return hf_logits(cross_encoder, ids)[0].item(), ids

    return compute


def test_cross_encoder_scores_each_pair_as_one_prompt(cross_encoder_server, pair_logit):
    status, body = post_json(
        cross_encoder_server.url_for("v1", "score"), {"text_1": QUERY, "text_2": DOCUMENTS}
    )
    assert status == 200, body
    references = [pair_logit(QUERY, d) for d in DOCUMENTS]
    expected = [torch.sigmoid(torch.tensor(logit)).item() for logit, _ in references]
    assert [d["score"] for d in body["data"]] == pytest.approx(expected, abs=1e-5)
    assert body["usage"]["prompt_tokens"] == sum(len(ids) for _, ids in references)

    status, body = post_json(
        cross_encoder_server.url_for("rerank"),
        {"query": QUERY, "documents": DOCUMENTS, "use_activation": False},
    )
    assert status == 200, body
    logits = {i: logit for i, (logit, _) in enumerate(references)}
    assert [r["index"] for r in body["results"]] == sorted(logits, key=logits.get, reverse=True)
    for result in body["results"]:
        assert result["relevance_score"] == pytest.approx(logits[result["index"]], abs=1e-5)
    assert body["usage"] == {"total_tokens": sum(len(ids) for _, ids in references)}


@pytest.mark.parametrize(
    "path, body, param, says",
    [
        ("score", {"text_1": "a " * 40, "text_2": "b " * 40}, "text_2", "maximum context length"),
        ("score", {"text_1": "a", "text_2": "b", "use_activation": 1}, "use_activation", "boolean"),
        ("rerank", {"query": "\ud800", "documents": ["b"]}, None, "not valid utf-8"),
    ],
)
def test_cross_encoder_bad_requests_are_400(cross_encoder_server, path, body, param, says):
    status, error = post_json(cross_encoder_server.url_for(path), body)
    assert status == 400, error
    assert says.lower() in error["error"]["message"].lower()
    if param is not None:  # a lone surrogate is refused with the body, before its fields
        assert error["error"]["param"] == param
    status, body = post_json(cross_encoder_server.url_for("score"), {"text_1": "a", "text_2": "b"})
    assert status == 200 and 0 < body["data"][0]["score"] < 1
