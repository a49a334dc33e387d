"""LLM.embed / LLM.encode (the pooling runner) against HF transformers' hidden states."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.outputs import EmbeddingRequestOutput, PoolingRequestOutput, ScoringRequestOutput
from minivllm.pooling_params import PoolingParams
from tests.conftest import write_tiny_checkpoint

PROMPTS = [
    "Hello, my name is",
    "The quick brown fox jumps over the lazy dog. Then the dog ran after the fox, "
    "across the field and into the forest, where it lost the trail.",
    "北京是中国的首都，",
    "a",
]
ENGINE = dict(enable_multiprocessing=False, kv_cache_memory_bytes=1 << 24, max_model_len=256)


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def checkpoint(request, tmp_path_factory, smollm2_tokenizer) -> str:
    folder = tmp_path_factory.mktemp(f"embed-{request.param}")
    return write_tiny_checkpoint(request.param, str(folder), smollm2_tokenizer)


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    import transformers

    return transformers.AutoModel.from_pretrained(checkpoint, dtype=torch.float32).eval()


def hf_embedding(hf_model, ids: list[int], pooling: str = "LAST", normalize: bool = True):
    """sentence-transformers' pooling of HF's last hidden states."""
    with torch.no_grad():
        hidden = hf_model(torch.tensor([ids])).last_hidden_state[0]
    vector = {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[pooling]
    return torch.nn.functional.normalize(vector, dim=-1) if normalize else vector


def assert_embeddings_equal_hf(outputs, hf_model, pooling="LAST", normalize=True) -> None:
    for output in outputs:
        expected = hf_embedding(hf_model, output.prompt_token_ids, pooling, normalize)
        got = torch.tensor(output.outputs.embedding)
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(
    ("pooling", "normalize"), [("LAST", True), ("MEAN", False), ("CLS", True), ("LAST", False)]
)
def test_embed_equals_hf_pooled_hidden_states(checkpoint, hf_model, pooling, normalize):
    config = {"pooling_type": pooling, "normalize": normalize}
    llm = LLM(checkpoint, runner="pooling", pooler_config=json.dumps(config), **ENGINE)
    outputs = llm.embed(PROMPTS, use_tqdm=False)
    assert [type(o) for o in outputs] == [EmbeddingRequestOutput] * len(PROMPTS)
    assert [o.prompt for o in outputs] == PROMPTS
    tokenizer = llm.get_tokenizer()
    assert [o.prompt_token_ids for o in outputs] == [tokenizer.encode(p) for p in PROMPTS]
    assert_embeddings_equal_hf(outputs, hf_model, pooling, normalize)
    if normalize:
        norms = [torch.tensor(o.outputs.embedding).norm().item() for o in outputs]
        assert norms == pytest.approx([1.0] * len(PROMPTS), abs=1e-5)


@pytest.mark.parametrize("pooling", ["LAST", "MEAN", "CLS"])
def test_chunked_prefill_gives_the_same_embeddings(checkpoint, hf_model, pooling):
    """Prompts cut into 8-token chunks (several requests sharing each step) pool as whole."""
    llm = LLM(
        checkpoint,
        runner="pooling",
        pooler_config={"pooling_type": pooling},
        max_num_batched_tokens=8,
        max_num_seqs=4,
        **ENGINE,
    )
    assert llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens == 8
    outputs = llm.embed(PROMPTS * 2, use_tqdm=False)
    assert_embeddings_equal_hf(outputs, hf_model, pooling)


def test_prefix_cache_hit_gives_the_same_embedding(checkpoint, hf_model):
    """LAST pooling keeps prefix caching: a cached prefix is not recomputed, and the last
    token always is (it alone is pooled)."""
    llm = LLM(checkpoint, runner="pooling", block_size=4, **ENGINE)
    assert llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
    (first,) = llm.embed(PROMPTS[1], use_tqdm=False)
    (again,) = llm.embed(PROMPTS[1], use_tqdm=False)
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens >= len(first.prompt_token_ids) - 4
    assert again.outputs.embedding == pytest.approx(first.outputs.embedding, abs=1e-6)
    assert_embeddings_equal_hf([again], hf_model)


def test_mean_and_cls_pooling_turn_prefix_caching_off(checkpoint):
    llm = LLM(checkpoint, runner="pooling", pooler_config={"pooling_type": "MEAN"}, **ENGINE)
    assert not llm.llm_engine.vllm_config.cache_config.enable_prefix_caching


def test_encode_params_truncation_and_order(checkpoint, hf_model):
    llm = LLM(checkpoint, task="embed", **ENGINE)  # vLLM's older name for the runner
    ids = llm.get_tokenizer().encode(PROMPTS[1])
    params = [PoolingParams(), PoolingParams(normalize=False), PoolingParams()]
    prompts = [PROMPTS[0], PROMPTS[0], {"prompt_token_ids": ids}]
    outputs = llm.encode(prompts, params, truncate_prompt_tokens=5, use_tqdm=False)
    assert [type(o) for o in outputs] == [PoolingRequestOutput] * 3
    assert all(o.finish_reason == "stop" and o.finished for o in outputs)
    # The last 5 tokens are kept, as for generation.
    assert outputs[2].prompt_token_ids == ids[-5:]
    raw = hf_embedding(hf_model, outputs[1].prompt_token_ids, normalize=False)
    torch.testing.assert_close(outputs[1].outputs.data, raw, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(
        outputs[0].outputs.data, torch.nn.functional.normalize(raw, dim=-1), atol=2e-5, rtol=1e-4
    )
    (whole,) = llm.encode({"prompt_token_ids": ids}, truncate_prompt_tokens=-1, use_tqdm=False)
    assert whole.prompt_token_ids == ids  # -1: up to max_model_len


def test_score_is_the_cosine_of_the_pairs_embeddings(checkpoint, hf_model):
    llm = LLM(checkpoint, runner="pooling", **ENGINE)
    tokenizer = llm.get_tokenizer()
    ids = [tokenizer.encode(p) for p in PROMPTS]
    padding = [] if tokenizer.pad_token_id is None else [tokenizer.pad_token_id]

    def expected(i: int, j: int) -> float:
        first, second = hf_embedding(hf_model, ids[i]), hf_embedding(hf_model, ids[j])
        return torch.cosine_similarity(first, second, dim=0).item()

    # 1:N: the one text against each; N:N: in order.
    for data_1, data_2, pairs in [
        (PROMPTS[0], PROMPTS[1:], [(0, 1), (0, 2), (0, 3)]),
        (PROMPTS[:2], [PROMPTS[3], {"prompt_token_ids": ids[2]}], [(0, 3), (1, 2)]),
    ]:
        outputs = llm.score(data_1, data_2, use_tqdm=False)
        assert [type(o) for o in outputs] == [ScoringRequestOutput] * len(pairs)
        assert len({o.request_id for o in outputs}) == len(pairs)
        assert [o.prompt_token_ids for o in outputs] == [
            ids[i] + padding + ids[j] for i, j in pairs
        ]
        scores = [o.outputs.score for o in outputs]
        assert scores == pytest.approx([expected(i, j) for i, j in pairs], abs=1e-5)
        assert len(set(scores)) == len(scores)  # different texts: different scores
    # A text against itself, unnormalized embeddings included: 1.
    (same,) = llm.score(
        PROMPTS[1], PROMPTS[1], pooling_params=PoolingParams(normalize=False), use_tqdm=False
    )
    assert same.outputs.score == pytest.approx(1.0, abs=1e-5)


def test_score_refuses_unpaired_inputs(checkpoint):
    llm = LLM(checkpoint, runner="pooling", **ENGINE)
    with pytest.raises(ValueError, match="1:1, 1:N or N:N"):
        llm.score(PROMPTS[:2], PROMPTS[:3], use_tqdm=False)
    with pytest.raises(ValueError, match="At least one text"):
        llm.score([], PROMPTS, use_tqdm=False)
    assert len(llm.score("a", ["b", "c"], use_tqdm=False)) == 2  # and the engine goes on
    with pytest.raises(ValueError, match="runner='pooling'"):
        LLM(checkpoint, **ENGINE).score("a", "b", use_tqdm=False)  # a generative model


def test_matryoshka_dimensions(tmp_path, smollm2_tokenizer):
    folder = write_tiny_checkpoint("qwen3", str(tmp_path / "m"), smollm2_tokenizer)
    llm = LLM(folder, runner="pooling", **ENGINE)
    with pytest.raises(ValueError, match="does not support matryoshka"):
        llm.embed("hi", PoolingParams(dimensions=16), use_tqdm=False)
    config_file = os.path.join(folder, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    with open(config_file, "w") as f:
        json.dump({**config, "is_matryoshka": True}, f)
    llm = LLM(folder, runner="pooling", **ENGINE)
    full, cut = llm.embed(
        ["hi there", "hi there"], [PoolingParams(), PoolingParams(dimensions=16)], use_tqdm=False
    )
    assert len(full.outputs.embedding) == 64 and cut.outputs.hidden_size == 16
    unnormalized = llm.encode("hi there", PoolingParams(normalize=False), use_tqdm=False)[0]
    expected = torch.nn.functional.normalize(unnormalized.outputs.data[:16], dim=-1)
    torch.testing.assert_close(torch.tensor(cut.outputs.embedding), expected)
    with pytest.raises(ValueError, match="at most the model's hidden size"):
        llm.embed("hi", PoolingParams(dimensions=65), use_tqdm=False)


def test_wrong_runner_for_the_call_is_a_value_error(checkpoint):
    pooling = LLM(checkpoint, runner="pooling", **ENGINE)
    with pytest.raises(ValueError, match="runner='generate'"):
        pooling.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)
    generating = LLM(checkpoint, **ENGINE)  # auto: a ...ForCausalLM generates
    assert generating.llm_engine.model_config.runner_type == "generate"
    with pytest.raises(ValueError, match="runner='pooling'"):
        generating.embed("hi", use_tqdm=False)
    # Nothing was left behind: both still serve their own kind of request.
    assert len(pooling.embed("hi", use_tqdm=False)[0].outputs.embedding) == 64
    assert generating.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)[0].finished


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"runner": "draft"}, "runner must be one of"),
        ({"convert": "classify"}, "convert must be one of"),
        ({"task": "score"}, "task must be one of"),
        ({"pooler_config": '{"pooling_type": "max"}'}, "pooling_type must be one of"),
        ({"pooler_config": "{not json"}, "not valid JSON"),
        ({"pooler_config": {"pooling": "MEAN"}}, "Unknown pooler_config field"),
    ],
)
def test_bad_pooling_arguments_are_value_errors(checkpoint, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(checkpoint, **kwargs, **ENGINE)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dimensions": 0}, "dimensions must be at least 1"),
        ({"dimensions": 1.5}, "dimensions must be an integer"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be"),
        ({"normalize": "yes"}, "normalize must be a boolean"),
        ({"task": "token_embed"}, "not supported"),
    ],
)
def test_bad_pooling_params_are_value_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PoolingParams(**kwargs)


def test_bare_sentence_transformers_checkpoint_pools_by_its_own_config(tmp_path, smollm2_tokenizer):
    """An embedding model as released: the bare network (architectures ["Qwen3Model"], no
    "model." prefix, no LM head) and sentence-transformers' modules.json saying MEAN and
    Normalize. runner "auto" pools it, with the pooling it declares; the engine runs in its
    own process here, as by default."""
    import transformers

    causal = write_tiny_checkpoint("qwen3", str(tmp_path / "causal"), smollm2_tokenizer)
    bare = str(tmp_path / "bare")
    hf_model = transformers.AutoModel.from_pretrained(causal, dtype=torch.float32).eval()
    hf_model.save_pretrained(bare)
    smollm2_tokenizer.save_pretrained(bare)
    with open(os.path.join(bare, "config.json")) as f:
        assert json.load(f)["architectures"] == ["Qwen3Model"]
    st = "sentence_transformers.models."
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": st + "Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": st + "Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": st + "Normalize"},
    ]
    with open(os.path.join(bare, "modules.json"), "w") as f:
        json.dump(modules, f)
    os.makedirs(os.path.join(bare, "1_Pooling"))
    with open(os.path.join(bare, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True}, f)
    shutil.rmtree(causal)

    llm = LLM(bare, kv_cache_memory_bytes=1 << 24, max_model_len=256)
    config = llm.llm_engine.model_config
    assert (config.runner_type, config.pooler_config.pooling_type) == ("pooling", "MEAN")
    assert config.pooler_config.normalize
    assert_embeddings_equal_hf(llm.embed(PROMPTS, use_tqdm=False), hf_model, "MEAN")
    llm.llm_engine.shutdown()


@pytest.mark.parametrize(("gguf_type", "pooling"), [(3, "LAST"), (1, "MEAN")])
def test_gguf_with_a_pooling_type_is_served_as_an_embedding_model(
    tmp_path, smollm2_tokenizer, gguf_type, pooling
):
    """llama.cpp's embedding GGUFs name their pooling ({arch}.pooling_type): runner "auto"
    pools them that way, normalized as llama.cpp does; the output head is not loaded."""
    import transformers

    from tests.model.test_loader import _write_gguf

    folder = write_tiny_checkpoint("qwen3", str(tmp_path / "hf"), smollm2_tokenizer)
    causal = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    path = str(tmp_path / "embed.gguf")
    _write_gguf(path, "qwen3", causal.config, causal.state_dict(), pooling_type=gguf_type)
    llm = LLM(path, tokenizer=folder, **ENGINE)
    config = llm.llm_engine.model_config
    assert (config.runner_type, config.pooler_config.pooling_type) == ("pooling", pooling)
    assert config.pooler_config.normalize
    assert_embeddings_equal_hf(llm.embed(PROMPTS, use_tqdm=False), causal.model.eval(), pooling)


def test_bundled_model_as_an_embedding_model_equals_hf(smollm2_path, smollm2_hf):
    """The real model, its GGUF dequantized, pooled by its last token: HF's hidden state;
    its blocks kept (int8 activations), within a cosine of 0.99 of it."""
    exact = LLM(smollm2_path, runner="pooling", quantization="none", **ENGINE)
    assert_embeddings_equal_hf(exact.embed(PROMPTS, use_tqdm=False), smollm2_hf.model)
    kept = LLM(smollm2_path, convert="embed", **ENGINE)  # vLLM's --convert embed
    assert kept.llm_engine.quantization == "gguf"
    for output in kept.embed(PROMPTS, use_tqdm=False):
        expected = hf_embedding(smollm2_hf.model, output.prompt_token_ids)
        assert float(torch.tensor(output.outputs.embedding) @ expected) > 0.99


def test_two_tensor_parallel_ranks_give_the_same_embeddings(tmp_path, smollm2_tokenizer):
    """Rank 0 pools the hidden states every rank holds whole; two worker processes."""
    import transformers

    folder = write_tiny_checkpoint("qwen3", str(tmp_path / "tp"), smollm2_tokenizer)
    hf_model = transformers.AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    llm = LLM(
        folder,
        runner="pooling",
        tensor_parallel_size=2,
        pooler_config={"pooling_type": "MEAN"},
        kv_cache_memory_bytes=1 << 24,
        max_model_len=256,
    )
    assert_embeddings_equal_hf(llm.embed(PROMPTS, use_tqdm=False), hf_model, "MEAN")
    llm.llm_engine.shutdown()
