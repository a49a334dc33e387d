"""What serving a LoRA adapter costs on the bundled model: one stream's decode rate and a
batch's output rate, with LoRA off, with it on for base-model requests, and with every
request under a rank-16 adapter of all seven projections. Each run is a fresh process; the
modes alternate.

    .venv/bin/python benchmarks/lora_overhead.py --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

MODES = ("lora off", "lora on, base requests", "lora requests")
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(folder: str, rank: int) -> None:
    """A random rank-`rank` adapter of every projection of the bundled model (its shapes
    from the GGUF's config)."""
    import torch
    from safetensors.torch import save_file

    from minivllm.config import EngineArgs
    from minivllm.engine.llm_engine import create_vllm_config

    config = create_vllm_config(EngineArgs()).model_config.hf_config
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = hidden // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    shapes = {
        "self_attn.q_proj": (hidden, hidden), "self_attn.k_proj": (kv, hidden),
        "self_attn.v_proj": (kv, hidden), "self_attn.o_proj": (hidden, hidden),
        "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden),
        "mlp.down_proj": (hidden, inter),
    }  # fmt: skip
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for name, (out_features, in_features) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_features) * 0.01
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_features, rank) * 0.01
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                   "target_modules": list(TARGETS)}, f)  # fmt: skip


def run_in_this_process(mode: str, adapter: str, num_prompts: int) -> dict:
    from minivllm import LLM, SamplingParams
    from minivllm.bench.datasets import random_token_prompts
    from minivllm.lora.request import LoRARequest

    llm = LLM(enable_prefix_caching=False, enable_lora=mode != "lora off")
    lora = LoRARequest("bench", 1, adapter) if mode == "lora requests" else None
    prompts = random_token_prompts(llm.get_tokenizer(), num_prompts, 128, seed=0)
    warm = SamplingParams(max_tokens=2)
    llm.generate({"prompt_token_ids": prompts[0][:16]}, warm, lora_request=lora, use_tqdm=False)
    result = {}
    one = SamplingParams(temperature=0, ignore_eos=True, max_tokens=256)
    start = time.perf_counter()
    llm.generate({"prompt_token_ids": prompts[0][:16]}, one, lora_request=lora, use_tqdm=False)
    result["one_stream_tok_s"] = 256 / (time.perf_counter() - start)
    batch = SamplingParams(temperature=0, ignore_eos=True, max_tokens=128)
    start = time.perf_counter()
    llm.generate(
        [{"prompt_token_ids": p} for p in prompts], batch, lora_request=lora, use_tqdm=False
    )
    result["batch_output_tok_s"] = num_prompts * 128 / (time.perf_counter() - start)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs of each mode")
    parser.add_argument("--num-prompts", type=int, default=64, help="the batch's prompts")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--adapter", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_in_this_process(args.child, args.adapter, args.num_prompts)))
        return
    adapter = tempfile.mkdtemp(prefix="lora-bench-")
    write_adapter(adapter, args.rank)
    results = {mode: {"one_stream_tok_s": [], "batch_output_tok_s": []} for mode in MODES}
    for i in range(args.runs):
        for mode in MODES:
            command = [sys.executable, __file__, "--child", mode, "--adapter", adapter]
            command += ["--num-prompts", str(args.num_prompts)]
            out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            result = json.loads(out.strip().splitlines()[-1])
            for key, value in result.items():
                results[mode][key].append(value)
            print(
                f"run {i + 1} {mode:>24}: one stream {result['one_stream_tok_s']:6.1f} tok/s, "
                f"batch {result['batch_output_tok_s']:6.1f} output tok/s",
                flush=True,
            )
    for mode in MODES:
        one = statistics.median(results[mode]["one_stream_tok_s"])
        batch = statistics.median(results[mode]["batch_output_tok_s"])
        print(f"median {mode:>24}: one stream {one:6.1f} tok/s, batch {batch:6.1f} output tok/s")


if __name__ == "__main__":
    main()
