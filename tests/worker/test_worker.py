"""The worker's KV caches on the host: each layer's in a 2 MiB-aligned map that Linux may
back with transparent huge pages (a long context's decode reads each KV head's runs of a
block, blocks apart), ordinary pages with MINIVLLM_CPU_HUGE_PAGES=0; the greedy tokens are
the same either way."""

from __future__ import annotations

from minivllm import LLM, SamplingParams
from minivllm.utils.huge_pages import HUGE_PAGE
from tests.utils.test_huge_pages import thp_eligible, transparent_huge_pages


def test_host_kv_caches_lie_in_huge_pages_and_keep_the_greedy_tokens(monkeypatch):
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    tokens = {}
    for huge in (True, False):
        monkeypatch.setenv("MINIVLLM_CPU_HUGE_PAGES", "1" if huge else "0")
        # 96 MiB over the bundled model's 30 layers: ~3 MiB a layer, a whole huge page.
        llm = LLM(enable_multiprocessing=False, max_model_len=256, kv_cache_memory_bytes=96 << 20)
        worker = llm.llm_engine.engine_core.engine_core.executor.worker
        caches = worker.kv_caches
        assert len(caches) == 30 and all(c.numel() * c.element_size() >= HUGE_PAGE for c in caches)
        if huge:
            assert all(c.data_ptr() % HUGE_PAGE == 0 for c in caches)
            if transparent_huge_pages():
                assert all(thp_eligible(c.data_ptr()) for c in caches)
        outputs = llm.generate(prompts, params)
        tokens[huge] = [o.outputs[0].token_ids for o in outputs]
        del llm, worker, caches
    assert tokens[True] == tokens[False]
