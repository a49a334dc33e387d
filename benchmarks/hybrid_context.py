"""One stream's decode rate at a short and a long context on a hybrid model, against a
Llama of the same width and layer count: the hybrid's state does not grow with the context,
so its rate at 4k tokens should be within 10% of its rate at 128 (issue 50, acceptance 4),
and each request's cache (printed from the worker's accounting) should be a fraction of
the Llama's (acceptance 3).

Writes random-weight HF checkpoints with the released models' shapes (transformers' own
classes; the bundled SmolLM2 tokenizer, whose vocabulary replaces theirs) unless they exist:

- lfm2: LFM2-1.2B (hidden 2048, 16 layers, 6 of them attention with 32 / 8 heads of 64,
  short convolutions of 3 taps elsewhere, MLP 8192);
- granite-h: Granite 4.0-H micro's width (hidden 2048, Mamba-2 with 64 heads of 64 and a
  state of 128 in 1 group, attention 32 / 8 heads of 64 in every 10th layer; 20 layers);
- qwen3.5: Qwen3.5-0.8B's shape (hidden 1024, 24 layers, every 4th gated attention with
  8 / 2 heads of 256, Gated DeltaNet elsewhere with 16 key and 16 value heads of 128 and a
  conv of 4 taps, MLP 3584);
- llama: a Llama of the same hidden size and layer count as the one asked.

    .venv/bin/python benchmarks/hybrid_context.py --family lfm2 --dir /tmp/hybrid
    .venv/bin/python benchmarks/hybrid_context.py --family llama --like lfm2 --dir /tmp/hybrid
    .venv/bin/python benchmarks/hybrid_context.py --family qwen3.5 --dir /tmp/hybrid
    .venv/bin/python benchmarks/hybrid_context.py --family llama --like qwen3.5 --dir /tmp/hybrid

Prints, per context: the prompt's rate (its tokens over the time to the first token) and
the decode rate (tokens 2..N over their time), and the cache a request of that length
holds. Run the two families alternately on a quiet machine, as BENCHMARKS.md says.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

SHAPES = {
    "lfm2": dict(hidden=2048, layers=16, heads=32, kv_heads=8, ff=8192),
    "granite-h": dict(hidden=2048, layers=20, heads=32, kv_heads=8, ff=8192),
    "qwen3.5": dict(hidden=1024, layers=24, heads=8, kv_heads=2, ff=3584, head_dim=256),
}


def write_checkpoint(family: str, like: str, folder: str) -> str:
    import transformers

    from minivllm.model.loader import default_model_path
    from minivllm.tokenizer import load_tokenizer

    if os.path.exists(os.path.join(folder, "config.json")):
        return folder
    tokenizer = load_tokenizer(default_model_path())
    s = SHAPES[like]
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=s["hidden"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    if "head_dim" in s:  # the Llama "like" it too
        common["head_dim"] = s["head_dim"]
    if family == "lfm2":
        attention = {2, 5, 8, 10, 12, 14}
        config = transformers.Lfm2Config(
            intermediate_size=s["ff"] * 3 // 2,  # LFM2 keeps 2/3 of it
            block_multiple_of=256,
            layer_types=[
                "full_attention" if i in attention else "conv" for i in range(s["layers"])
            ],
            conv_L_cache=3,
            **common,
        )
        cls = transformers.Lfm2ForCausalLM
    elif family == "granite-h":
        config = transformers.GraniteMoeHybridConfig(
            intermediate_size=s["ff"],
            shared_intermediate_size=s["ff"],
            num_local_experts=0,
            layer_types=["attention" if i % 10 == 9 else "mamba" for i in range(s["layers"])],
            mamba_n_heads=64,
            mamba_d_head=64,
            mamba_n_groups=1,
            mamba_d_state=128,
            mamba_expand=2,
            **common,
        )
        cls = transformers.GraniteMoeHybridForCausalLM
    elif family == "qwen3.5":
        config = transformers.Qwen3_5TextConfig(
            intermediate_size=s["ff"],
            linear_num_key_heads=16,
            linear_num_value_heads=16,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_conv_kernel_dim=4,
            **common,
        )
        cls = transformers.Qwen3_5ForCausalLM
    else:
        config = transformers.LlamaConfig(intermediate_size=s["ff"], **common)
        cls = transformers.LlamaForCausalLM
    torch.manual_seed(0)
    model = cls(config).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def measure(
    folder: str, contexts: list[int], decode: int, threads: int | None, inproc: bool
) -> None:
    from minivllm import LLM, SamplingParams

    if threads:
        torch.set_num_threads(threads)
    llm = LLM(
        folder,
        max_model_len=max(contexts) + decode + 8,
        enable_prefix_caching=False,
        enable_multiprocessing=not inproc,
    )
    worker_spec = None
    engine = getattr(llm.llm_engine.engine_core, "engine_core", None)
    if engine is not None and hasattr(engine.executor, "worker"):
        worker_spec = engine.executor.worker.kv_cache_spec()
    print(f"{'context':>8} {'prompt tok/s':>13} {'decode tok/s':>13} {'cache MiB':>10}")
    for context in contexts:
        prompt = {"prompt_token_ids": [(i * 7919) % 30000 + 100 for i in range(context)]}
        one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        many = SamplingParams(temperature=0, max_tokens=decode + 1, ignore_eos=True)
        llm.generate(prompt, one, use_tqdm=False)  # warm-up at this length

        def best_of_three(params, prompt=prompt) -> float:
            times = []
            for _ in range(3):
                start = time.perf_counter()
                llm.generate(prompt, params, use_tqdm=False)
                times.append(time.perf_counter() - start)
            return min(times)

        first, total = best_of_three(one), best_of_three(many)
        cache = worker_spec.request_bytes(context) / (1 << 20) if worker_spec else float("nan")
        rates = f"{context / first:>13.1f} {decode / (total - first):>13.2f}"
        print(f"{context:>8} {rates} {cache:>10.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--family", choices=["lfm2", "granite-h", "qwen3.5", "llama"], required=True
    )
    parser.add_argument("--like", choices=sorted(SHAPES), default=None, help="llama's shape")
    parser.add_argument("--dir", required=True, help="where the checkpoints are written")
    parser.add_argument("--contexts", default="128,512,4096")
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--inproc",
        action="store_true",
        help="engine core in this process: prints each "
        "request's cache bytes (the worker's accounting), no overlap of detokenizing",
    )
    args = parser.parse_args()
    like = args.like or (args.family if args.family in SHAPES else "lfm2")
    folder = os.path.join(args.dir, f"{args.family}-{like}")
    write_checkpoint(args.family, like, folder)
    contexts = [int(c) for c in args.contexts.split(",")]
    measure(folder, contexts, args.decode, args.threads, args.inproc)


if __name__ == "__main__":
    main()
