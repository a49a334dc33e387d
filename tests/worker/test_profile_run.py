"""The profiling pass: one dummy step at the scheduler's limits on the platform's device,
with a temporary KV cache that leaves no trace (the GPU sizes its KV cache from it)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from minivllm import LLM, EngineArgs, SamplingParams
from minivllm.engine.create_config import create_vllm_config
from minivllm.worker.worker import Worker

PROMPTS = ["Hello, my name is", "The capital of France is", "1, 1, 2, 3, 5, 8,"]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def loaded_worker(model: str, **kwargs) -> Worker:
    worker = Worker(create_vllm_config(EngineArgs(model=model, **kwargs)))
    worker.init_device()
    worker.load_model()
    return worker


@pytest.mark.parametrize(
    "limits, num_blocks",
    [
        # 100 tokens over 8 prompts of 12-13 tokens: one 16-token block each.
        (dict(max_num_seqs=8, max_num_batched_tokens=100, max_model_len=256), 8),
        # A step holds at most 2 prompts of 40 tokens: 80 tokens, 3 blocks each.
        (dict(max_num_seqs=2, max_num_batched_tokens=500, max_model_len=40), 6),
        # Fewer tokens than requests: 4 one-token prompts.
        (dict(max_num_seqs=8, max_num_batched_tokens=4, max_model_len=256), 4),
    ],
    ids=["spread", "capped-by-max-model-len", "one-token-prompts"],
)
def test_profile_run_binds_a_just_large_enough_cache_and_unbinds_it(tiny_model, limits, num_blocks):
    worker = loaded_worker(tiny_model, **limits)
    assert worker.profile_run() == num_blocks * worker.kv_cache_bytes_per_block()
    assert all(attn.kv_cache is None for attn in worker.model.attention_layers())


def test_profile_run_leaves_the_real_cache_bound_and_untouched(tiny_model):
    worker = loaded_worker(tiny_model, max_num_seqs=4, max_model_len=256)
    worker.initialize_kv_cache(worker.determine_num_blocks())
    for cache in worker.kv_caches:
        cache.fill_(1.0)
    worker.profile_run()
    for attn, cache in zip(worker.model.attention_layers(), worker.kv_caches):
        assert attn.kv_cache is cache
        assert bool((cache == 1.0).all())


def test_the_cpu_sizes_its_cache_without_profiling(tiny_model, monkeypatch):
    worker = loaded_worker(tiny_model, max_model_len=256, kv_cache_memory_bytes=1 << 22)

    def no_profiling():
        raise AssertionError("the CPU's KV cache size is configured, not measured")

    monkeypatch.setattr(worker, "profile_run", no_profiling)
    assert worker.determine_available_memory() == 1 << 22
    assert worker.determine_num_blocks() == (1 << 22) // worker.kv_cache_bytes_per_block()


def test_greedy_tokens_are_the_same_after_a_profiling_pass(tiny_model):
    """The prompts' blocks stay in the prefix cache: a pass that wrote into the real KV
    cache would change the second generation."""
    llm = LLM(tiny_model, max_model_len=256, max_num_seqs=8, enable_multiprocessing=False)
    try:
        before = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        llm.llm_engine.engine_core.engine_core.executor.worker.profile_run()
        after = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    assert [o.outputs[0].token_ids for o in after] == [o.outputs[0].token_ids for o in before]


@pytest.fixture
def qwen3_shaped_checkpoint() -> str:
    """Random weights in Qwen3-0.6B's shape (benchmarks/gpu_checkpoints.py): no model file
    travels to a GPU machine, and real activation sizes make the profiling meaningful."""
    sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
    import gpu_checkpoints

    return gpu_checkpoints.write_checkpoint("qwen3-0.6b", "bfloat16")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_the_gpu_budget_is_measured_and_its_blocks_fit(qwen3_shaped_checkpoint):
    utilization = 0.5
    worker = loaded_worker(
        qwen3_shaped_checkpoint,
        device="cuda",
        max_model_len=4096,
        gpu_memory_utilization=utilization,
    )
    budget = worker.determine_available_memory()
    assert 0 < budget <= torch.cuda.mem_get_info()[1] * utilization
    assert all(attn.kv_cache is None for attn in worker.model.attention_layers())
    num_blocks = worker.determine_num_blocks()
    worker.initialize_kv_cache(num_blocks)
    assert sum(c.numel() * c.element_size() for c in worker.kv_caches) <= budget
    worker.profile_run()  # a step at the limits still fits beside the real cache
