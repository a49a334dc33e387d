"""On CUDA: greedy outputs equal HF transformers' on random-weight checkpoints with
Qwen3-0.6B's and Llama-3.2-1B's shapes (benchmarks/gpu_checkpoints.py), with CUDA graphs
on and off, prefix caching, chunked prefill and forced preemption.

The reference is HF transformers on the same device and in the same dtype. Every token the
engine emits is checked against HF's logits for the same context (the engine's own
sequence, run through HF in one forward): it must be HF's top token, or within a margin of
it (a near-tie). In float32 the margin is a tie at float32 rounding (1e-4), and the
sequences must also equal HF's own greedy decoding up to the first such tie. In bfloat16
rounding differs between any two implementations: on these checkpoints HF's bf16 logits
differ from its float32 ones by up to 0.06 (Qwen3 shape, logits' std 0.64) and 0.15
(Llama shape, std 0.90), and pick another top token at 7-10% of positions (measured on the
CPU). So in bf16 the margin is 0.5, and at least 80% of the engine's tokens must be HF's
top one; a token off by a wrong kernel lands ~3 logits below the top.

Marked `gpu` and skipped without CUDA. To develop the test on a machine without one, set
MINIVLLM_GPU_PARITY_DEVICE=cpu: the same matrix then runs on the CPU with the models'
tiny variants (same families, 2 layers), in about two minutes; add
MINIVLLM_ATTENTION_BACKEND=TRITON_ATTN TRITON_INTERPRET=1 to run the GPU's attention
kernels under Triton's interpreter (about five minutes a dtype).

    python -m pytest -m gpu tests/worker/test_gpu_parity.py -k qwen3   # then -k llama
"""

from __future__ import annotations

import gc
import os
import sys
from dataclasses import dataclass

import numpy as np
import pytest
import torch

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "benchmarks")
sys.path.insert(0, BENCHMARKS)

import gpu_checkpoints  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else os.environ.get("MINIVLLM_GPU_PARITY_DEVICE")
TINY = DEVICE == "cpu"

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE is None, reason="needs CUDA (or MINIVLLM_GPU_PARITY_DEVICE=cpu)"),
]

MODELS = ("qwen3-0.6b", "llama-3.2-1b")
DTYPES = ("float32", "bfloat16")
MARGIN = {"float32": 1e-4, "bfloat16": 0.5}  # logits; see the docstring
MIN_TOP_SHARE = 0.8  # of tokens that are HF's top one, in bfloat16
BLOCK_SIZE = 16
MAX_MODEL_LEN = 512
MAX_NUM_SEQS = 16

# Prompt lengths around block edges and past the chunked budget; different output lengths,
# so the decode batch shrinks step by step (each size a different captured graph).
PROMPT_LENS = (3, 16, 17, 45, 64, 130, 257, 300)
MAX_TOKENS = (40, 33, 8, 24, 17, 40, 12, 29)
CHUNK_BUDGET = 64  # max_num_batched_tokens of the chunked mode: 300 tokens take 5 steps
PREFIX_LEN = 100  # six whole blocks shared, and a partial one
SUFFIX_LENS = (5, 30, 17, 64)
# Six requests that each end in 6-7 blocks, in a pool of 12: four start (3 blocks each),
# and the first new block any of them needs preempts another.
PREEMPT_PROMPT_LENS = (40, 41, 47, 33, 38, 45)
PREEMPT_MAX_TOKENS = 60
PREEMPT_POOL_BLOCKS = 12

# Async scheduling is on by default on CUDA: the first five modes run without it.
SYNC = {"async_scheduling": False}
MODES = {
    "cuda-graphs": SYNC,
    "eager": {"enforce_eager": True, **SYNC},
    "prefix-caching": {"enable_prefix_caching": True, **SYNC},
    "chunked-prefill": {"max_num_batched_tokens": CHUNK_BUDGET, **SYNC},
    # The engine wants a max_model_len request to fit in the pool.
    "preemption": {"max_model_len": PREEMPT_POOL_BLOCKS * BLOCK_SIZE, **SYNC},
    # Step N+1 launched before step N's ids reach the host (they reach its inputs on the
    # device), with CUDA graphs; and so while requests are preempted with tokens in flight.
    "async-scheduling": {"async_scheduling": True},
    "async-preemption": {
        "max_model_len": PREEMPT_POOL_BLOCKS * BLOCK_SIZE,
        "async_scheduling": True,
    },
}


def random_prompts(vocab: dict, lens, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    allowed = np.array(sorted(set(range(vocab["vocab_size"])) - vocab["special"]))
    return [rng.choice(allowed, n).tolist() for n in lens]


def blocks(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK_SIZE)


@dataclass
class Check:
    """How one engine sequence compares with the reference."""

    greedy_prefix: int  # tokens equal to HF's greedy decoding before the first difference
    gaps: list[float]  # per output token: HF's top logit - HF's logit of the engine's token

    @property
    def worst(self) -> int:
        return max(range(len(self.gaps)), key=self.gaps.__getitem__)


class Reference:
    """HF transformers on the device, in the dtype under test, for one checkpoint."""

    def __init__(self, name: str, folder: str, dtype: str) -> None:
        import transformers

        self.folder, self.dtype = folder, dtype
        self.config = gpu_checkpoints.model_config(name, TINY)
        self.model = (
            transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype))
            .to(DEVICE)
            .eval()
        )
        self._greedy: dict[tuple[int, ...], list[int]] = {}

    @property
    def vocab(self) -> dict:
        special = {self.config["bos_token_id"], self.config["eos_token_id"]}
        return {"vocab_size": self.config["vocab_size"], "special": special}

    def kv_bytes(self, num_blocks: int) -> int:
        dtype_bytes = torch.empty(0, dtype=getattr(torch, self.dtype)).element_size()
        per_token = gpu_checkpoints.kv_bytes_per_token(self.config, dtype_bytes)
        return num_blocks * BLOCK_SIZE * per_token

    @torch.inference_mode()
    def greedy(self, prompt: list[int], n: int) -> list[int]:
        """HF's greedy decoding (its forward with its KV cache, no logits processors)."""
        key = tuple(prompt)
        done = self._greedy.get(key, [])
        if len(done) < n:
            out = self.model(torch.tensor([prompt], device=DEVICE), use_cache=True)
            tokens = [int(out.logits[0, -1].argmax())]
            while len(tokens) < n:
                step = torch.tensor([[tokens[-1]]], device=DEVICE)
                out = self.model(step, past_key_values=out.past_key_values, use_cache=True)
                tokens.append(int(out.logits[0, -1].argmax()))
            self._greedy[key] = done = tokens
        return done[:n]

    @torch.inference_mode()
    def check(self, prompt: list[int], tokens: list[int]) -> Check:
        seq = torch.tensor([prompt + tokens[:-1]], device=DEVICE)
        logits = self.model(seq).logits[0, len(prompt) - 1 :].float()
        chosen = logits.gather(1, torch.tensor(tokens, device=DEVICE)[:, None])[:, 0]
        gaps = (logits.max(dim=1).values - chosen).tolist()
        greedy = self.greedy(prompt, len(tokens))
        prefix = next((i for i, (a, b) in enumerate(zip(tokens, greedy)) if a != b), len(tokens))
        return Check(prefix, gaps)


@pytest.fixture(scope="module", params=[(m, d) for m in MODELS for d in DTYPES], ids="-".join)
def reference(request, tmp_path_factory):
    name, dtype = request.param
    out = os.environ.get("MINIVLLM_GPU_CHECKPOINTS") or str(tmp_path_factory.getbasetemp())
    folder = gpu_checkpoints.write_checkpoint(name, "float32", out, tiny=TINY)
    ref = Reference(name, folder, dtype)
    yield ref
    del ref.model
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def run_engine(ref: Reference, mode: str, waves: list[list[list[int]]], max_tokens) -> tuple:
    """Run the waves of prompts (one generate call each) on a fresh engine in ``mode``."""
    from minivllm import LLM, SamplingParams

    prompts = [p for wave in waves for p in wave]
    need = sum(blocks(len(p) + m) for p, m in zip(prompts, max_tokens))
    pool = PREEMPT_POOL_BLOCKS if mode.endswith("preemption") else 2 * need + 16
    args = dict(max_model_len=MAX_MODEL_LEN, enable_prefix_caching=False) | MODES[mode]
    llm = LLM(
        ref.folder,
        device=DEVICE,
        dtype=ref.dtype,
        max_num_seqs=MAX_NUM_SEQS,
        block_size=BLOCK_SIZE,
        kv_cache_memory_bytes=ref.kv_bytes(pool),
        **args,
    )
    try:
        outputs, params = [], iter(max_tokens)
        for wave in waves:
            sampling = [
                SamplingParams(temperature=0, max_tokens=next(params), ignore_eos=True)
                for _ in wave
            ]
            outputs += llm.generate(
                [{"prompt_token_ids": p} for p in wave], sampling, use_tqdm=False
            )
        stats = llm.llm_engine.last_stats
    finally:
        llm.llm_engine.shutdown()
        del llm
        gc.collect()
    return prompts, outputs, stats


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_outputs_match_transformers(reference, mode):
    ref = reference
    if mode == "prefix-caching":
        prefix = random_prompts(ref.vocab, [PREFIX_LEN], seed=11)[0]
        suffixes = random_prompts(ref.vocab, SUFFIX_LENS, seed=12)
        shared = [prefix + s for s in suffixes]
        # The first prompt alone fills the cache; the second wave hits it, once with the
        # very same prompt (all but its last token come from the cache).
        waves = [shared[:1], shared[1:] + shared[:1]]
        max_tokens = [32, 24, 40, 16, 32, 32]
    elif mode.endswith("preemption"):
        waves = [random_prompts(ref.vocab, PREEMPT_PROMPT_LENS, seed=13)]
        max_tokens = [PREEMPT_MAX_TOKENS] * len(PREEMPT_PROMPT_LENS)
    else:
        waves = [random_prompts(ref.vocab, PROMPT_LENS, seed=10)]
        max_tokens = list(MAX_TOKENS)
    prompts, outputs, stats = run_engine(ref, mode, waves, max_tokens)

    failures, distinct, top, total = [], set(), 0, 0
    for prompt, output, n in zip(prompts, outputs, max_tokens):
        tokens = list(output.outputs[0].token_ids)
        assert output.prompt_token_ids == prompt
        assert len(tokens) == n
        check = ref.check(prompt, tokens)
        distinct.update(tokens)
        top += sum(gap == 0.0 for gap in check.gaps)
        total += n
        where = f"prompt of {len(prompt)} tokens"
        gap = check.gaps[check.worst]
        if gap > MARGIN[ref.dtype]:
            failures.append(f"{where}, output {check.worst}: HF's top logit is {gap:.4g} above")
        elif ref.dtype == "float32" and check.greedy_prefix < n:
            # Float32 may leave HF's own greedy decoding only at a tie; after it the engine's
            # tokens are checked against HF on the engine's context, as above.
            tie = check.gaps[check.greedy_prefix]
            if tie == 0.0:  # HF on the engine's context agrees: the difference is HF's own
                tie = ref.check(prompt, ref.greedy(prompt, n)).gaps[check.greedy_prefix]
            if tie > MARGIN["float32"]:
                failures.append(f"{where}, output {check.greedy_prefix}: not HF's greedy token")
    assert not failures, f"{mode}, {ref.dtype}: " + "; ".join(failures)
    assert top >= MIN_TOP_SHARE * total, f"only {top} of {total} tokens are HF's top one"
    # The comparison means something only if the outputs do (random weights can collapse).
    assert len(distinct) >= len(prompts), f"degenerate outputs: {len(distinct)} distinct tokens"

    if mode == "prefix-caching":
        for output in outputs[1:]:
            assert output.num_cached_tokens >= (PREFIX_LEN // BLOCK_SIZE) * BLOCK_SIZE
        if ref.dtype == "float32":
            # The very same prompt, from the cache the second time. In bfloat16 only the
            # margin check above holds: the second run's last prompt row and decode steps
            # are matrix products of another batch shape (five requests, not one), which
            # cuBLAS may sum in another order, and random weights are full of near-ties
            # (on the H200, 2026-11-26, the runs parted at their 16th token).
            assert outputs[-1].outputs[0].token_ids == outputs[0].outputs[0].token_ids
    elif mode.endswith("preemption"):
        assert stats is not None and stats.num_preemptions > 0, "the pool forced no preemption"
    else:
        assert all(o.num_cached_tokens == 0 for o in outputs)
