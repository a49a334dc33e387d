#!/usr/bin/env python
"""Interleaved A/B of the GGUF prompt path: one engine, its GGUF layers' kernel switched
between a build without the decoded tiles (-DPROMPT_ROWS=1000000) and the default one,
prompt by prompt, so that a slow spell of the machine falls on both (separate processes
alternating could not resolve 10-20% here). The packed layout is the same in both builds.

    python benchmarks/prompt_kernel_ab.py FILE.gguf PROMPT_TOKENS ROUNDS
"""

import statistics
import sys
import time

from minivllm import LLM, SamplingParams
from minivllm.kernels import gguf_kernels as gk
from minivllm.model.layers.quantization.gguf import quantized_weight

model, n_tokens, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
llm = LLM(
    model,
    max_model_len=4096,
    enable_multiprocessing=False,
    enable_prefix_caching=False,
    kv_cache_memory_bytes=1 << 29,
)
runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
weights = {id(w): w for p in runner.model.parameters() if (w := quantized_weight(p)) is not None}
# The packed layout is the same in both builds; the MoE layers reach the library through
# gguf_kernels._lib(), the linear layers through the kernel each weight keeps.
libraries = {
    "tile": gk.load_gguf_kernels(("-DPROMPT_ROWS=1000000",)),
    "decoded": gk.load_gguf_kernels(),
}
params = SamplingParams(max_tokens=1, temperature=0)
times = {name: [] for name in libraries}
for r in range(rounds + 2):
    for name, lib in libraries.items() if r % 2 == 0 else reversed(libraries.items()):
        for w in weights.values():
            w.kernel = lib.gguf_packed_matmul
        gk._lib = lambda lib=lib: lib
        ids = [(1000 + 7 * r + i) % 30000 + 100 for i in range(n_tokens)]
        t = time.perf_counter()
        llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
        if r >= 2:
            times[name].append(time.perf_counter() - t)
med = {n: statistics.median(v) * 1e3 for n, v in times.items()}
print(
    f"{model.split('/')[-1]} {n_tokens} tokens, {rounds} rounds: tile {med['tile']:.1f} ms, "
    f"decoded {med['decoded']:.1f} ms, x{med['tile'] / med['decoded']:.3f} "
    f"(min {min(times['tile']) * 1e3:.1f} / {min(times['decoded']) * 1e3:.1f})"
)
