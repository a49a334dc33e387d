"""Pipeline parallelism with worker processes: the greedy tokens of one stage, with
chunked prefill, prefix caching and preemption; each stage holding half the weights and
KV cache; models that cannot split refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from minivllm import LLM, SamplingParams
from minivllm.engine.batch_queue import BatchQueue
from tests.conftest import write_tiny_checkpoint

PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "Write a poem about the sea:",
    "1, 1, 2, 3, 5,",
    "The capital of France is a city that",  # shares a prefix with the second
    "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n",
]


def params() -> list[SamplingParams]:
    """Mixed lengths, so requests finish at different steps; logprobs on some."""
    return [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2 if i % 2 else None)
        for i, n in enumerate((24, 40, 7, 31, 1, 20))
    ]


@pytest.fixture(scope="module")
def tiny_llama4(tmp_path_factory, smollm2_tokenizer) -> str:
    """A random-weight 4-layer Llama, 4 heads and 2 KV heads: 2 stages of 2 tensor-parallel
    ranks."""
    folder = tmp_path_factory.mktemp("tiny-llama-pp")
    return write_tiny_checkpoint("llama", str(folder), smollm2_tokenizer, num_hidden_layers=4)


def kv_bytes_per_token(model: str, layers: int, kv_heads: int) -> int:
    config = json.loads((Path(model) / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    return 2 * layers * kv_heads * head_dim * 4


@pytest.fixture
def most_in_flight(monkeypatch) -> list[int]:
    """The most batches in flight after a step of the batch queue (it fills the queue
    again before it returns)."""
    seen = [0]
    step = BatchQueue.step

    def spy(self):
        outputs = step(self)
        seen[0] = max(seen[0], len(self))
        return outputs

    monkeypatch.setattr(BatchQueue, "step", spy)
    return seen


def generate(
    model: str, pp: int = 1, tp: int = 1, inspect=None, **kwargs
) -> tuple[list[tuple], int]:
    """Room for 96 tokens in every worker's KV cache (each holds its stage's layers and
    its rank's KV heads): the requests need ~200 at once, so some are preempted. Steps of
    at most 16 tokens: prompts are chunked. The engine core runs here (its scheduler is
    read)."""
    per_token = kv_bytes_per_token(model, 4 // pp, 2 // tp)
    llm = LLM(
        model,
        seed=0,
        max_model_len=96,
        block_size=4,
        max_num_batched_tokens=16,
        kv_cache_memory_bytes=96 * per_token,
        enable_prefix_caching=True,
        pipeline_parallel_size=pp,
        tensor_parallel_size=tp,
        enable_multiprocessing=False,
        **kwargs,
    )
    try:
        if inspect is not None:  # the running engine's LLM, before it generates
            inspect(llm)
        outputs = llm.generate(PROMPTS, params(), use_tqdm=False)
        preemptions = llm.llm_engine.engine_core.engine_core.scheduler.num_preemptions
    finally:
        llm.llm_engine.shutdown()
    got = [
        (
            o.outputs[0].token_ids,
            [sorted(lp) for lp in o.outputs[0].logprobs or []],
        )
        for o in outputs
    ]
    return got, preemptions


@pytest.fixture(scope="module")
def one_stage(tiny_llama4) -> tuple[list[tuple], int]:
    return generate(tiny_llama4)


def test_two_stages_give_one_stages_tokens(tiny_llama4, one_stage, most_in_flight, monkeypatch):
    # A batch more than stages (vLLM's queue holds one a stage): more steps interleave.
    monkeypatch.setenv("MINIVLLM_PP_EXTRA_BATCHES", "1")
    expected, preempted = one_stage
    got, preempted_pp = generate(tiny_llama4, pp=2)
    assert got == expected
    assert preempted > 0 and preempted_pp > 0
    assert most_in_flight[0] == 3


@pytest.mark.slow  # four worker processes on the test machine's cores
def test_two_stages_of_two_tensor_parallel_ranks(tiny_llama4, one_stage):
    expected, _ = one_stage
    got, preempted = generate(tiny_llama4, pp=2, tp=2)
    assert got == expected
    assert preempted > 0


@pytest.mark.slow  # two engines
def test_uneven_stages_from_vllm_pp_layer_partition(tiny_llama4, one_stage, monkeypatch):
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "1,3")
    expected, _ = one_stage
    llm = LLM(
        tiny_llama4, seed=0, max_model_len=128, pipeline_parallel_size=2,
        enable_multiprocessing=False,
    )  # fmt: skip
    try:
        executor = llm.llm_engine.engine_core.engine_core.executor
        per_block = executor.collective_rpc("kv_cache_bytes_per_block")
        got = llm.generate(PROMPTS, params(), use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    assert per_block[1] == 3 * per_block[0]  # one layer's cache, then three's
    assert [o.outputs[0].token_ids for o in got] == [tokens for tokens, _ in expected]


def test_a_model_that_cannot_split_is_refused(tmp_path, smollm2_tokenizer):
    model = write_tiny_checkpoint("opt", str(tmp_path), smollm2_tokenizer)
    with pytest.raises(Exception, match="does not support pipeline parallelism"):
        LLM(model, pipeline_parallel_size=2, enable_multiprocessing=False)


def test_options_that_stages_do_not_run_are_refused(tiny_llama4):
    with pytest.raises(ValueError, match="speculative_config"):
        LLM(
            tiny_llama4,
            pipeline_parallel_size=2,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        )
    with pytest.raises(ValueError, match="more stages than the model's 4 layers"):
        LLM(tiny_llama4, pipeline_parallel_size=5)
    with pytest.raises(ValueError, match="async_scheduling"):
        LLM(tiny_llama4, pipeline_parallel_size=2, async_scheduling=True)


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory, smollm2_tokenizer) -> str:
    """An 8-layer Llama of width 1024 (about 0.9 GiB of float32 weights, half of them in
    the layers, a fifth each in the embedding and the untied head): its weights dominate
    a worker's memory. Config only: the engine makes random weights (load_format dummy)."""
    import transformers

    folder = tmp_path_factory.mktemp("wide-llama")
    transformers.LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=len(smollm2_tokenizer),
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=smollm2_tokenizer.bos_token_id,
        eos_token_id=smollm2_tokenizer.eos_token_id,
    ).save_pretrained(folder)
    smollm2_tokenizer.save_pretrained(folder)
    return str(folder)


def worker_memory(model: str, pp: int) -> tuple[list[int], list[int], list[int]]:
    """(RSS, weight bytes, KV cache bytes per block) of each worker process, after a
    request ran through every stage."""
    llm = LLM(
        model,
        load_format="dummy",
        max_model_len=256,
        kv_cache_memory_bytes=64 << 20,
        pipeline_parallel_size=pp,
        distributed_executor_backend="mp",
        enforce_eager=True,
        enable_multiprocessing=False,
    )
    try:
        llm.generate(["Hello"], SamplingParams(max_tokens=2), use_tqdm=False)
        executor = llm.llm_engine.engine_core.engine_core.executor
        rss = [rss_bytes(pid) for pid in executor.worker_pids]
        weights = executor.collective_rpc("get_weight_memory_bytes")
        per_block = executor.collective_rpc("kv_cache_bytes_per_block")
    finally:
        llm.llm_engine.shutdown()
    return rss, weights, per_block


@pytest.mark.slow  # ~1 GiB of random weights made twice
def test_each_stage_holds_half_the_weights_and_kv_cache(wide_llama):
    (rss_one,), (weights_one,), (block_one,) = worker_memory(wide_llama, 1)
    rss_two, weights_two, block_two = worker_memory(wide_llama, 2)
    # About half each: the first stage holds the embedding, the last the LM head (packed
    # for the CPU's GEMM, a copy more).
    assert sum(weights_two) == pytest.approx(weights_one, rel=0.02)
    for weights, per_block in zip(weights_two, block_two):
        assert weights == pytest.approx(weights_one / 2, rel=0.25)
        assert per_block == block_one // 2
    # The process's own memory (torch, the interpreter) is the same in each; a stage
    # saves what it does not hold, a third of the weights at least (a generous margin).
    for rss in rss_two:
        assert rss_one - rss > weights_one / 3, (rss_one, rss_two, weights_one)
