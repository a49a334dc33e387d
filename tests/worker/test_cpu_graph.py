"""Decode steps replayed as kernel calls (worker/cpu_graph.py) give the eager steps' greedy
tokens, on the bundled model kept quantized and dequantized to float32, and on Qwen3 and
Gemma 3 checkpoints (q/k norms; Gemma's sliding-window layers)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from minivllm import LLM, SamplingParams
from minivllm.kernels import cpu_kernels
from minivllm.kernels.cpu_kernels import load_kernels
from minivllm.model.loader import default_model_path
from minivllm.worker.cpu_graph import _program
from tests.conftest import write_tiny_checkpoint

pytestmark = pytest.mark.skipif(
    load_kernels("MINIVLLM_CPU_ATTN_KERNEL") is None, reason="no C compiler"
)

PROMPTS = ["The capital of France is", "def fib(n):", "Once upon a time", "1, 2, 3,", "Hi", "A"]


def run(monkeypatch, graphs: str, quantization: str, model: str | None = None, **llm_kwargs):
    monkeypatch.setenv("MINIVLLM_ENABLE_MULTIPROCESSING", "0")
    monkeypatch.setenv("MINIVLLM_CPU_GRAPHS", graphs)
    llm = LLM(
        model or default_model_path(),
        quantization=quantization,
        kv_cache_memory_bytes=1 << 28,
        max_model_len=512,
        enable_prefix_caching=False,
        **llm_kwargs,
    )
    # Different lengths: the batch shrinks 6, 5, ... 1 as requests finish.
    params = [
        SamplingParams(max_tokens=8 + 5 * n, temperature=0, ignore_eos=True) for n in range(6)
    ]
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
    return [o.outputs[0].token_ids for o in outputs], runner.cpu_graphs


@pytest.mark.parametrize("quantization", ["gguf", "none"])
def test_replayed_steps_give_the_eager_tokens(monkeypatch, quantization):
    replayed, graphs = run(monkeypatch, "1", quantization)
    eager, no_graphs = run(monkeypatch, "0", quantization)
    assert replayed == eager
    assert no_graphs is None
    kept = sorted(size for size, graph in graphs.items() if graph is not None)
    # Every op a kernel (GGUF's, or the small-batch panels in float32): every size replays,
    # its calls made from C in one run.
    assert kept == [1, 2, 3, 4, 5, 6]
    assert [len(graphs[size].program) for size in kept] == [1] * 6
    # The LM head in that run too: each replay leaves every row's logits in the graph.
    assert all(graphs[size].logits.shape == (size, 49152) for size in kept)


@pytest.mark.parametrize("arch", ["gemma3", "gemma2", "qwen3", "gemma4"])
def test_steps_with_head_norms_and_windows_replay(monkeypatch, tmp_path, smollm2_tokenizer, arch):
    """Qwen3's and Gemma 3's q/k norms over heads of the fused qkv rows (a strided view with
    more than one token); Gemma 3's sandwich norms, GeGLU, and sliding-window layers whose
    first attended positions the replay passes anew each step (the window, 8 tokens, is
    passed by the longer sequences early on). Gemma 4: per-layer embeddings (the graph's
    input holds their rows beside the embeddings), layers reading an earlier one's K/V."""
    folder = write_tiny_checkpoint(arch, str(tmp_path / arch), smollm2_tokenizer)
    replayed, graphs = run(monkeypatch, "1", "none", folder)
    eager, _ = run(monkeypatch, "0", "none", folder)
    assert replayed == eager
    assert sorted(size for size, graph in graphs.items() if graph is not None) == [1, 2, 3, 4, 5, 6]
    # Gemma 2's and Gemma 4's final soft cap (tanh) is no kernel: their graphs keep the
    # layers, the logits eager; Gemma 3's and Qwen3's LM heads replay.
    with_logits = {graph.logits is not None for graph in graphs.values() if graph is not None}
    assert with_logits == {arch in ("gemma3", "qwen3")}


def test_capturing_a_step_does_not_import_dynamo():
    """The capture watches torch's ops through a dispatch mode; torch wraps such a mode's
    handler in dynamo's disable unless told not to, and the first call of that imports
    torch._dynamo: 2.3 s added to the first request's first decode step."""
    script = (
        "import sys\n"
        "from minivllm import LLM, SamplingParams\n"
        "from minivllm.model.loader import default_model_path\n"
        "llm = LLM(default_model_path(), kv_cache_memory_bytes=1 << 26, max_model_len=256)\n"
        "llm.generate(['Hi'], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)\n"
        "runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner\n"
        "print(runner.cpu_graphs[1] is not None, 'torch._dynamo' in sys.modules)\n"
    )
    env = {**os.environ, "MINIVLLM_ENABLE_MULTIPROCESSING": "0", "MINIVLLM_CPU_GRAPHS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == ["True", "False"]


def test_without_the_library_a_program_makes_every_call_from_python(monkeypatch):
    """Runs of kernel calls are made by the C library's run_calls; where it is not built,
    each call is made from Python with the step's inputs filled in."""
    made = []

    def kernel(*args):
        made.append(args)

    kernel.slots = 1234  # would be a C run with the library
    monkeypatch.setattr(cpu_kernels, "load_library", lambda: None)
    program = _program([(kernel, (1, 2, 3), {1: "seq_lens"}), (kernel, (4,), None)])
    for call in program:
        call({"seq_lens": 99})
    assert made == [(1, 99, 3), (4,)]
