"""POST /classify on `minivllm serve` with a sequence classifier, over raw HTTP: each
prompt's probabilities equal HF transformers' softmax, its label the config's, bad inputs
400s, and the route refused where the model is not a classifier."""

from __future__ import annotations

import pytest
import torch

from tests.entrypoints.openai.utils import RemoteServer, post_json
from tests.entrypoints.test_llm_classify import LABELS, hf_logits, hf_probs, write_classifier

pytestmark = pytest.mark.e2e

NAME = "tiny-classifier"
TEXTS = ["Hello world", "The capital of France is Paris.", "a"]


@pytest.fixture(scope="module")
def classifier(tmp_path_factory, smollm2_tokenizer) -> str:
    folder = str(tmp_path_factory.mktemp("tiny-classify") / "model")
    return write_classifier("qwen3", folder, smollm2_tokenizer)


@pytest.fixture(scope="module")
def classify_server(classifier):
    remote = RemoteServer(
        [classifier, "--served-model-name", NAME, "--max-model-len", "64", "--dtype", "float32"]
    )
    yield remote
    remote.stop()


def test_classify_equals_hf(classify_server, classifier, smollm2_tokenizer):
    status, body = post_json(classify_server.url_for("classify"), {"model": NAME, "input": TEXTS})
    assert status == 200, body
    assert body["id"].startswith("classify-") and body["object"] == "list"
    assert body["model"] == NAME
    ids = [smollm2_tokenizer.encode(t) for t in TEXTS]
    for i, item in enumerate(body["data"]):
        assert item["index"] == i and item["num_classes"] == len(LABELS)
        expected = hf_probs(classifier, ids[i])
        torch.testing.assert_close(torch.tensor(item["probs"]), expected, atol=2e-5, rtol=1e-4)
        assert item["label"] == LABELS[int(expected.argmax())]
    assert body["usage"]["prompt_tokens"] == sum(len(x) for x in ids)
    status, one = post_json(classify_server.url_for("classify"), {"input": ids[1]})  # token ids
    assert status == 200 and one["data"][0]["probs"] == pytest.approx(body["data"][1]["probs"])
    # use_activation=false: the raw logits.
    status, raw = post_json(
        classify_server.url_for("classify"), {"input": TEXTS[1], "use_activation": False}
    )
    assert status == 200, raw
    expected = hf_logits(classifier, ids[1])
    torch.testing.assert_close(
        torch.tensor(raw["data"][0]["probs"]), expected, atol=2e-5, rtol=1e-4
    )


@pytest.mark.parametrize(
    "body, param, says",
    [
        ({"input": []}, "input", "empty list"),
        ({"input": ""}, "input", "empty string"),
        ({"input": [1, 10_000_000]}, "input", "out of vocabulary"),
        ({"input": "a " * 100}, "input", "maximum context length"),
        ({"input": "a", "priority": 1}, "priority", "not enabled"),
        ({"input": "a", "use_activation": "no"}, "use_activation", "boolean"),
    ],
)
def test_bad_requests_are_400(classify_server, body, param, says):
    status, error = post_json(classify_server.url_for("classify"), body)
    assert status == 400, error
    assert says.lower() in error["error"]["message"].lower()
    assert error["error"]["param"] == param


def test_a_classifier_serves_no_embeddings_and_others_no_classify(classify_server, server):
    status, error = post_json(classify_server.url_for("v1", "embeddings"), {"input": "a"})
    assert status == 400 and "does not support Embeddings API" in error["error"]["message"]
    # Three labels: no cross-encoder (test_score.py has one).
    status, error = post_json(classify_server.url_for("score"), {"text_1": "a", "text_2": "b"})
    assert status == 400 and "only enabled for num_labels == 1" in error["error"]["message"]
    status, error = post_json(server.url_for("classify"), {"input": "a"})  # a generative model
    assert status == 400 and "does not support Classification API" in error["error"]["message"]
    status, body = post_json(classify_server.url_for("classify"), {"input": "a"})
    assert status == 200 and sum(body["data"][0]["probs"]) == pytest.approx(1.0)
