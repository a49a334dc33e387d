"""LLM.classify (the pooling runner on a "...ForSequenceClassification" checkpoint) against
HF transformers' sequence classification."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from minivllm import LLM
from minivllm.outputs import ClassificationRequestOutput
from minivllm.pooling_params import PoolingParams
from tests.conftest import write_tiny_checkpoint

PROMPTS = ["Hello, my name is", "The quick brown fox jumps over the lazy dog.", "北京", "a"]
ENGINE = dict(enable_multiprocessing=False, kv_cache_memory_bytes=1 << 24, max_model_len=256)
LABELS = {0: "negative", 1: "neutral", 2: "positive"}


def write_classifier(arch: str, folder: str, tokenizer) -> str:
    """A tiny causal LM's checkpoint re-saved as HF's ...ForSequenceClassification of it,
    with a random 3-label `score` head."""
    import transformers

    lm = write_tiny_checkpoint(arch, folder + "-lm", tokenizer)
    config = transformers.AutoConfig.from_pretrained(lm)
    config.num_labels, config.id2label = len(LABELS), LABELS
    config.label2id = {v: k for k, v in LABELS.items()}
    name = type(transformers.AutoModelForCausalLM.from_config(config)).__name__
    config.architectures = [name.replace("ForCausalLM", "ForSequenceClassification")]
    torch.manual_seed(0)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(lm, config=config)
    model.score.weight.data.normal_(std=0.3)  # peaked probabilities: differences show
    model.save_pretrained(folder)
    for file in os.listdir(lm):
        if file.startswith(("tokenizer", "special_tokens")):
            shutil.copy(os.path.join(lm, file), folder)
    return folder


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def classifier(request, tmp_path_factory, smollm2_tokenizer) -> str:
    folder = str(tmp_path_factory.mktemp(f"cls-{request.param}") / "model")
    return write_classifier(request.param, folder, smollm2_tokenizer)


def hf_probs(folder: str, ids: list[int]) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        folder, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        return torch.softmax(model(torch.tensor([ids])).logits[0], dim=-1)


def test_classify_equals_hf_sequence_classification(classifier):
    llm = LLM(classifier, **ENGINE)  # runner "auto": a classifier pools
    assert llm.llm_engine.model_config.runner_type == "pooling"
    outputs = llm.classify(PROMPTS, use_tqdm=False)
    assert [type(o) for o in outputs] == [ClassificationRequestOutput] * len(PROMPTS)
    for output in outputs:
        assert output.outputs.num_classes == len(LABELS)
        expected = hf_probs(classifier, output.prompt_token_ids)
        torch.testing.assert_close(
            torch.tensor(output.outputs.probs), expected, atol=2e-5, rtol=1e-4
        )
    assert len({tuple(o.outputs.probs) for o in outputs}) == len(PROMPTS)
    # Chunked prompts (8 tokens a step) give the same probabilities.
    chunked = LLM(classifier, max_num_batched_tokens=8, **ENGINE).classify(PROMPTS, use_tqdm=False)
    for a, b in zip(outputs, chunked):
        assert a.outputs.probs == pytest.approx(b.outputs.probs, abs=1e-6)


def test_a_classifier_only_classifies(classifier):
    llm = LLM(classifier, runner="pooling", **ENGINE)
    with pytest.raises(ValueError, match="'embed' is not supported by this model"):
        llm.embed("hi", use_tqdm=False)
    with pytest.raises(ValueError, match="'embed' is not supported by this model"):
        llm.score("a", "b", use_tqdm=False)
    (output,) = llm.classify("hi", pooling_params=PoolingParams(task="classify"), use_tqdm=False)
    assert sum(output.outputs.probs) == pytest.approx(1.0)
    # And an embedding model (the same network without the head) does not classify.
    embedder = LLM(classifier + "-lm", runner="pooling", **ENGINE)
    with pytest.raises(ValueError, match="'classify' is not supported by this model"):
        embedder.classify("hi", use_tqdm=False)
    assert len(embedder.embed("hi", use_tqdm=False)[0].outputs.embedding) == 64
