"""LLM.classify (the pooling runner on a "...ForSequenceClassification" checkpoint) against
HF transformers' sequence classification."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from minivllm import LLM
from minivllm.outputs import ClassificationRequestOutput, ScoringRequestOutput
from minivllm.pooling_params import PoolingParams
from tests.conftest import write_tiny_checkpoint

PROMPTS = ["Hello, my name is", "The quick brown fox jumps over the lazy dog.", "北京", "a"]
ENGINE = dict(enable_multiprocessing=False, kv_cache_memory_bytes=1 << 24, max_model_len=256)
LABELS = {0: "negative", 1: "neutral", 2: "positive"}


def write_classifier(
    arch: str, folder: str, tokenizer, labels: dict = LABELS, **config_keys
) -> str:
    """A tiny causal LM's checkpoint re-saved as HF's ...ForSequenceClassification of it,
    with a random `score` head of len(labels) outputs."""
    import transformers

    lm = write_tiny_checkpoint(arch, folder + "-lm", tokenizer)
    config = transformers.AutoConfig.from_pretrained(lm)
    config.num_labels, config.id2label = len(labels), labels
    config.label2id = {v: k for k, v in labels.items()}
    for key, value in config_keys.items():
        setattr(config, key, value)
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
    (output,) = llm.classify("hi", pooling_params=PoolingParams(task="classify"), use_tqdm=False)
    assert sum(output.outputs.probs) == pytest.approx(1.0)
    # And an embedding model (the same network without the head) does not classify.
    embedder = LLM(classifier + "-lm", runner="pooling", **ENGINE)
    with pytest.raises(ValueError, match="'classify' is not supported by this model"):
        embedder.classify("hi", use_tqdm=False)
    assert len(embedder.embed("hi", use_tqdm=False)[0].outputs.embedding) == 64


def hf_logits(folder: str, ids: list[int]) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        folder, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def test_use_activation_false_returns_the_logits(classifier):
    llm = LLM(classifier, **ENGINE)
    (output,) = llm.classify(
        PROMPTS[1], pooling_params=PoolingParams(use_activation=False), use_tqdm=False
    )
    expected = hf_logits(classifier, output.prompt_token_ids)
    torch.testing.assert_close(torch.tensor(output.outputs.probs), expected, atol=2e-5, rtol=1e-4)
    assert sum(output.outputs.probs) != pytest.approx(1.0)
    with pytest.raises(ValueError, match="use_activation must be a boolean"):
        PoolingParams(use_activation="no")
    # A classifier of three labels is no cross-encoder: its scores would be three numbers.
    with pytest.raises(ValueError, match="only enabled for num_labels == 1"):
        llm.score("a", "b", use_tqdm=False)


# A cross-encoder's tokenizer marks where the second text starts (as BERT's [SEP] does), so
# the pair prompt is not the two encodings end to end.
SEPARATOR = "<|im_end|>"
QUERY = "What is the capital of France?"
DOCUMENTS = ["The capital of Brazil is Brasilia.", "Paris is the capital of France.", "北京"]


def write_cross_encoder(arch: str, folder: str, tokenizer, **config_keys) -> str:
    """A one-label classifier whose tokenizer encodes a pair as A <|im_end|> B."""
    import transformers
    from tokenizers.processors import TemplateProcessing

    write_classifier(arch, folder, tokenizer, {0: "LABEL_0"}, **config_keys)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    hf_tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single="$A",
        pair=f"$A {SEPARATOR} $B:1",
        special_tokens=[(SEPARATOR, hf_tokenizer.convert_tokens_to_ids(SEPARATOR))],
    )
    hf_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def cross_encoder(request, tmp_path_factory, smollm2_tokenizer) -> str:
    folder = str(tmp_path_factory.mktemp(f"ce-{request.param}") / "model")
    return write_cross_encoder(request.param, folder, smollm2_tokenizer)


def test_cross_encoder_score_equals_hf(cross_encoder):
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(cross_encoder)
    llm = LLM(cross_encoder, **ENGINE)
    assert llm.llm_engine.model_config.is_cross_encoder
    outputs = llm.score(QUERY, DOCUMENTS, use_tqdm=False)
    assert [type(o) for o in outputs] == [ScoringRequestOutput] * len(DOCUMENTS)
    separator = tokenizer.convert_tokens_to_ids(SEPARATOR)
    for document, output in zip(DOCUMENTS, outputs):
        ids = tokenizer(QUERY, text_pair=document)["input_ids"]
        assert output.prompt_token_ids == ids
        assert ids == tokenizer.encode(QUERY) + [separator] + tokenizer.encode(document)
        # sentence-transformers' CrossEncoder: the sigmoid of the one logit.
        expected = torch.sigmoid(hf_logits(cross_encoder, ids))[0].item()
        assert output.outputs.score == pytest.approx(expected, abs=2e-6)
    assert len({o.outputs.score for o in outputs}) == len(DOCUMENTS)
    # N:N pairs in order, token-id prompts (decoded to their text, as vLLM does) and the raw
    # logit on request.
    pairs = llm.score(
        [QUERY, {"prompt_token_ids": tokenizer.encode(DOCUMENTS[0])}],
        [{"prompt": DOCUMENTS[1]}, QUERY],
        pooling_params=PoolingParams(use_activation=False),
        use_tqdm=False,
    )
    for (a, b), output in zip([(QUERY, DOCUMENTS[1]), (DOCUMENTS[0], QUERY)], pairs):
        logit = hf_logits(cross_encoder, tokenizer(a, text_pair=b)["input_ids"])[0].item()
        assert output.outputs.score == pytest.approx(logit, abs=2e-5)
    # classify on the same model: the one label's probability, the pair's score when given
    # the pair's prompt.
    (classified,) = llm.classify({"prompt_token_ids": outputs[1].prompt_token_ids}, use_tqdm=False)
    assert classified.outputs.probs == pytest.approx([outputs[1].outputs.score], abs=1e-6)
    with pytest.raises(ValueError, match="'embed' is not supported by this model"):
        llm.embed("hi", use_tqdm=False)
    with pytest.raises(ValueError, match="Input lengths must be either 1:1, 1:N or N:N"):
        llm.score([QUERY, QUERY], DOCUMENTS, use_tqdm=False)
    with pytest.raises(ValueError, match="A text to score must be a string"):
        llm.score(QUERY, [3], use_tqdm=False)


def test_cross_encoder_activation_from_its_config(tmp_path, smollm2_tokenizer):
    """sentence-transformers saves its CrossEncoder's activation in config.json; an Identity
    scores with the raw logit. Only torch.nn modules may be named."""
    folder = write_cross_encoder(
        "qwen3",
        str(tmp_path / "identity"),
        smollm2_tokenizer,
        sentence_transformers={"activation_fn": "torch.nn.modules.linear.Identity"},
    )
    (output,) = LLM(folder, **ENGINE).score(QUERY, DOCUMENTS[0], use_tqdm=False)
    logit = hf_logits(folder, output.prompt_token_ids)[0].item()
    assert output.outputs.score == pytest.approx(logit, abs=2e-5)
    folder = write_cross_encoder(
        "qwen3",
        str(tmp_path / "hostile"),
        smollm2_tokenizer,
        sbert_ce_default_activation_function="os.system",
    )
    with pytest.raises(ValueError, match="restricted to torch.nn.modules"):
        LLM(folder, **ENGINE)
