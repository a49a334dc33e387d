"""The GPU's attention path through the whole engine: the Triton backend behind the same
runner, scheduler and sampler, on the GPU when there is one, else on the CPU under
TRITON_INTERPRET=1 (as in CI). Greedy tokens equal HF transformers', with chunked prefill,
prefix caching and preemption."""

from __future__ import annotations

import collections
import json
import types
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

# Where the Triton backend runs: the GPU when there is one, else the CPU (interpreted).
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

from minivllm import LLM, SamplingParams  # noqa: E402
from tests.conftest import write_tiny_checkpoint  # noqa: E402

# Six tokens: each is an interpreted step of every layer's kernels (the cost of this file).
MAX_NEW = 6
PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n",
    "Once upon a time, in a land far away, there lived a",
]


@pytest.fixture(scope="module", params=["qwen3", "gemma3-softcap"])
def model_dir(request, tmp_path_factory, smollm2_tokenizer) -> str:
    # Qwen3: GQA and q/k norms; Gemma 3: sliding windows shorter than the prompts, soft-caps.
    folder = tmp_path_factory.mktemp(f"tiny-{request.param}")
    return write_tiny_checkpoint(request.param, str(folder), smollm2_tokenizer)


def hf_greedy(model_dir: str, prompts: list[list[int]], hf=None) -> list[list[int]]:
    import transformers

    if hf is None:
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation="eager"
        ).eval()
    out = []
    with torch.inference_mode():
        for ids in prompts:
            seq = hf.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=MAX_NEW,
                do_sample=False,
                eos_token_id=-1,
                pad_token_id=0,
            )
            out.append(seq[0, len(ids) :].tolist())
    return out


def generate(monkeypatch, model_dir: str, prompts, backend: str, max_new=MAX_NEW, **kwargs):
    monkeypatch.setenv("MINIVLLM_ATTENTION_BACKEND", backend)
    device = "cpu" if backend == "CPU_ATTN" else TRITON_DEVICE
    llm = LLM(model_dir, max_model_len=128, device=device, enable_multiprocessing=False, **kwargs)
    runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
    assert runner.attn_backend.get_name() == backend
    params = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    llm.cached_tokens = sum(o.num_cached_tokens for o in outputs)
    return [o.outputs[0].token_ids for o in outputs], llm


def test_chunked_prefill_matches_transformers(monkeypatch, model_dir):
    # 16-token steps cut the longer prompts into chunks that start after earlier context.
    tokens, llm = generate(
        monkeypatch, model_dir, PROMPTS, "TRITON_ATTN", max_num_batched_tokens=16
    )
    ids = [llm.get_tokenizer().encode(p) for p in PROMPTS]
    assert tokens == hf_greedy(model_dir, ids)


def test_gpu_layer_kernels_match_transformers(monkeypatch, model_dir):
    """The GPU's Triton layer kernels (RMS norm with the residual add, SiLU-and-mul, RoPE)
    in the whole model, taken here for CPU tensors too (interpreted); each call counted."""
    from minivllm import kernels
    from minivllm.kernels import triton_layers
    from minivllm.model.layers import rotary

    used = collections.Counter()

    def counted(name):
        def call(*args, **kwargs):
            used[name] += 1
            return getattr(triton_layers, name)(*args, **kwargs)

        return call

    names = ("rms_norm", "silu_and_mul", "rotary_embedding")
    spy = types.SimpleNamespace(
        takes_rms_norm=triton_layers.takes_rms_norm, **{n: counted(n) for n in names}
    )
    monkeypatch.setattr(kernels, "triton_layers_for", lambda x: spy)
    monkeypatch.setenv("MINIVLLM_CPU_LAYER_KERNELS", "0")  # float32 CPU tensors: not C's
    # get_rope shares one RotaryEmbedding per process: one made by an earlier test holds C's.
    monkeypatch.setattr(rotary, "_ROPE_CACHE", {})
    tokens, llm = generate(monkeypatch, model_dir, PROMPTS, "TRITON_ATTN")
    ids = [llm.get_tokenizer().encode(p) for p in PROMPTS]
    assert tokens == hf_greedy(model_dir, ids)
    # Gemma 3's norms are Gemma's (1 + weight) and its MLP GeLU: only its RoPE is here.
    expected = names if "qwen3" in model_dir else ("rotary_embedding",)
    assert all(used[n] > 0 for n in expected), used


def test_prefix_caching_and_preemption_keep_the_greedy_tokens(monkeypatch, model_dir):
    # Prompts sharing a 40-token prefix (cache hits), in a KV cache too small for all of
    # them at once (preemption, then recomputation).
    shared = list(range(100, 140))
    prompts = [{"prompt_token_ids": shared + [200 + i] * (i + 1)} for i in range(6)]
    expected, _ = generate(monkeypatch, model_dir, prompts, "CPU_ATTN")
    config = json.loads((Path(model_dir) / "config.json").read_text())
    token_bytes = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * 32 * 4
    # 9 blocks of 16 tokens: one 128-token sequence fits, the six requests (2 shared blocks
    # and 10 of their own) not.
    kv_bytes = 9 * 16 * token_bytes
    tokens, llm = generate(
        monkeypatch, model_dir, prompts, "TRITON_ATTN", kv_cache_memory_bytes=kv_bytes
    )
    assert tokens == expected
    assert llm.llm_engine.engine_core.engine_core.scheduler.num_preemptions > 0
    assert llm.cached_tokens > 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_decode_graphs_replay_the_eager_tokens(monkeypatch, model_dir, async_scheduling):
    """The CUDA-graph runner's static inputs, padding and LM head, on the CPU: there a
    "replay" reruns the captured step (forward pass, logits, argmax) over the same buffers
    (no graph), so what is checked is everything around the capture: the inputs sent into
    the graphs' buffers by ``InputBatch.prepare`` (with async scheduling, the tokens in
    flight written there on the device), the padded rows, and the draw taken from the
    graph's argmax when every row is plainly greedy. The graphs are built for 1024-token
    contexts (the model takes 512), so their launch splits the keys in two (split-KV),
    which the eager steps of these short contexts never do.
    """
    from minivllm.worker.cuda_graph import CudaGraphRunner

    if async_scheduling and "gemma" in model_dir:
        pytest.skip("one model is enough for the tokens in flight (an interpreted run: ~20 s)")
    prompts = PROMPTS + ["A", "1, 2, 3,"]
    # Different lengths: the batch shrinks by one row a step as requests finish (5, 4, 3,
    # 2, 1 decode rows: padded 8, 4, 4, 2, 1). The first three ask for logprobs (the
    # sampler runs on the graph's logits); once they are done, every row is plainly greedy
    # (the graph's argmax is the draw).
    params = [
        SamplingParams(
            temperature=0, max_tokens=1 + i, ignore_eos=True, logprobs=0 if i < 3 else None
        )
        for i in range(len(prompts))
    ]
    monkeypatch.setenv("MINIVLLM_ATTENTION_BACKEND", "TRITON_ATTN")
    results, replayed, sampler_calls = [], [], []
    for graphs in (False, True):
        llm = LLM(
            model_dir,
            max_model_len=512,
            device=TRITON_DEVICE,
            enable_multiprocessing=False,
            async_scheduling=async_scheduling,
        )
        runner = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner
        if graphs:
            runner.cuda_graphs = CudaGraphRunner(
                runner.model,
                runner.attn_backend,
                [1, 2, 4, 8],
                1024,
                16,
                runner.device,
                capture=False,
                with_logits=True,
            )
            runner.cuda_graphs.capture()
            for size, replay in runner.cuda_graphs.replays.items():
                runner.cuda_graphs.replays[size] = lambda r=replay, s=size: (
                    replayed.append(s) or r()
                )
        sampler = runner.sampler
        calls = collections.Counter()
        runner.sampler = lambda logits, meta, f=sampler, c=calls: (
            c.update(["call"]) or f(logits, meta)
        )
        outputs = llm.generate(prompts, params, use_tqdm=False)
        results.append([o.outputs[0] for o in outputs])
        sampler_calls.append(calls["call"])
    eager, replays = results
    assert [o.token_ids for o in replays] == [o.token_ids for o in eager]
    # Logprobs too: a cache slot that a padded row overwrote would shift them (padding only
    # changes how many rows each matrix product has, worth a few float32 ulps).
    for a, b in zip(replays[:3], eager[:3]):
        assert [lp[t].logprob for lp, t in zip(a.logprobs, a.token_ids)] == pytest.approx(
            [lp[t].logprob for lp, t in zip(b.logprobs, b.token_ids)], abs=1e-5
        )
    assert set(replayed) == {1, 2, 4, 8}
    # The last requests' steps (plainly greedy) took the graph's argmax, not the sampler.
    assert sampler_calls[1] < sampler_calls[0]


def test_bfloat16_matches_transformers_up_to_near_ties(monkeypatch, model_dir):
    """bfloat16, the GPU's default dtype: where the tokens part, HF's own logits for its
    token and for ours are within two bfloat16 steps (a near-tie that rounding decides;
    the kernel keeps its scores in float32 where HF rounds them to bfloat16). Ties are
    common with this tiny model: 49k logits of about 10 where bfloat16 steps by 1/16."""
    import transformers

    monkeypatch.setenv("MINIVLLM_ATTENTION_BACKEND", "TRITON_ATTN")
    llm = LLM(
        model_dir,
        dtype="bfloat16",
        max_model_len=128,
        device=TRITON_DEVICE,
        enable_multiprocessing=False,
    )
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16, attn_implementation="eager"
    ).eval()
    ids = [llm.get_tokenizer().encode(p) for p in PROMPTS]
    for prompt, expected, output in zip(ids, hf_greedy(model_dir, ids, hf), outputs):
        tokens = output.outputs[0].token_ids
        n = next((i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b), None)
        if n is None:
            continue
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt + expected[:n]])).logits[0, -1].float()
        top = logits[expected[n]]
        step = 2.0 ** (torch.floor(torch.log2(top.abs())) - 7)  # bfloat16's spacing there
        assert top - logits[tokens[n]] <= 2 * step, (prompt, n)


def test_speculative_decoding_rows_match_the_plain_engine(monkeypatch, tmp_path, smollm2_tokenizer):
    """Proposals through the Triton backend, 16-token steps: while prompts are chunked,
    proposal rows go to the kernel as several-token rows beside the chunks; once every
    request decodes, a step of decode and proposal rows goes as one-token rows, each at its
    own position. The proposer knows the plain engine's tokens and is wrong every other time.
    (Qwen3 alone: the interpreter takes minutes an architecture.)"""
    from tests.spec_decode import oracle

    model_dir = write_tiny_checkpoint("qwen3", str(tmp_path / "qwen3"), smollm2_tokenizer)
    # 8 tokens a prompt: enough decode steps for more than 10 accepted proposals (6: 10).
    expected, llm = generate(monkeypatch, model_dir, PROMPTS, "TRITON_ATTN", max_new=8)
    llm.llm_engine.shutdown()
    tokenizer = llm.get_tokenizer()
    full = [tokenizer.encode(p) + out for p, out in zip(PROMPTS, expected)]
    oracle.install(monkeypatch, full)
    got, llm = generate(
        monkeypatch,
        model_dir,
        PROMPTS,
        "TRITON_ATTN",
        max_new=8,
        speculative_config={"num_speculative_tokens": 3},
        max_num_batched_tokens=16,
    )
    stats = llm.llm_engine.engine_core.engine_core.scheduler.make_stats()
    llm.llm_engine.shutdown()
    assert got == expected
    assert stats.spec_decode_num_accepted_tokens > 10
