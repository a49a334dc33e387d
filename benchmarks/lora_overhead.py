"""What serving a LoRA adapter costs, and how it compares with vLLM's CPU build.

Modes: LoRA off; LoRA on with base-model requests; every request under a rank-16 adapter of
all seven projections. Each run is a fresh process measuring one stream's decode (16 tokens
in, 256 out) and a batch's output rate (64 prompts x 128 random tokens, 128 out); the modes
(or engines) alternate.

    .venv/bin/python benchmarks/lora_overhead.py --runs 3              # bundled GGUF, modes
    .venv/bin/python benchmarks/lora_overhead.py --runs 3 --against-vllm

--against-vllm runs both engines on the float32 HF directory (prepare_model.py) with every
request under the adapter; vLLM from its own virtualenv (~/peer-vllm), both cores bound.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

MODES = ("lora off", "lora on, base requests", "lora requests")
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PEER_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "4",
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
}


def write_adapter(folder: str, rank: int) -> None:
    """A random rank-`rank` adapter of every projection of the bundled model (its shapes
    from the GGUF's config)."""
    import torch
    from safetensors.torch import save_file

    from minivllm.engine.arg_utils import EngineArgs
    from minivllm.engine.create_config import create_vllm_config

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


def measure(engine: str, mode: str, model: str | None, adapter: str, num_prompts: int) -> dict:
    """One run: (one stream's tok/s, the batch's output tok/s), in this process."""
    if engine == "vllm":
        from vllm import LLM, SamplingParams
        from vllm.lora.request import LoRARequest

        kwargs = dict(dtype="float32", max_lora_rank=16)
    else:
        from minivllm import LLM, SamplingParams
        from minivllm.lora.request import LoRARequest

        kwargs = {}
    llm = LLM(model, enable_prefix_caching=False, enable_lora=mode != "lora off", **kwargs)
    lora = LoRARequest("bench", 1, adapter) if mode == "lora requests" else None
    rng = random.Random(0)  # the same token ids for both engines
    prompts = [[rng.randrange(100, 40000) for _ in range(128)] for _ in range(num_prompts)]
    first = {"prompt_token_ids": prompts[0][:16]}
    llm.generate(first, SamplingParams(max_tokens=2), lora_request=lora, use_tqdm=False)
    one = SamplingParams(temperature=0, ignore_eos=True, max_tokens=256)
    start = time.perf_counter()
    llm.generate(first, one, lora_request=lora, use_tqdm=False)
    result = {"one_stream_tok_s": 256 / (time.perf_counter() - start)}
    batch = SamplingParams(temperature=0, ignore_eos=True, max_tokens=128)
    start = time.perf_counter()
    llm.generate(
        [{"prompt_token_ids": p} for p in prompts], batch, lora_request=lora, use_tqdm=False
    )
    result["batch_output_tok_s"] = num_prompts * 128 / (time.perf_counter() - start)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs of each mode or engine")
    parser.add_argument("--num-prompts", type=int, default=64, help="the batch's prompts")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--against-vllm", action="store_true")
    parser.add_argument("--peer", default=os.path.expanduser("~/peer-vllm"))
    parser.add_argument("--child", help=argparse.SUPPRESS)  # JSON: engine, mode, model, adapter
    args = parser.parse_args()
    if args.child:
        spec = json.loads(args.child)
        print(json.dumps(measure(**spec, num_prompts=args.num_prompts)))
        return
    adapter = tempfile.mkdtemp(prefix="lora-bench-")
    write_adapter(adapter, args.rank)
    if args.against_vllm:
        sys.path.insert(0, os.path.dirname(__file__))
        from prepare_model import prepare

        model = prepare()
        python = {"minivllm": sys.executable, "vllm": os.path.join(args.peer, "bin", "python")}
        cases = [(engine, "lora requests", model) for engine in ("minivllm", "vllm")]
    else:
        python = {"minivllm": sys.executable}
        cases = [("minivllm", mode, None) for mode in MODES]
    results: dict[tuple, dict[str, list[float]]] = {c[:2]: {} for c in cases}
    for i in range(args.runs):
        for engine, mode, model in cases:
            spec = json.dumps(dict(engine=engine, mode=mode, model=model, adapter=adapter))
            command = [python[engine], __file__, "--child", spec]
            command += ["--num-prompts", str(args.num_prompts)]
            env = {**os.environ, **(PEER_ENV if engine == "vllm" else {})}
            out = subprocess.run(command, check=True, capture_output=True, text=True, env=env)
            # vLLM logs its shutdown to stdout after the result line.
            result = json.loads(next(x for x in reversed(out.stdout.splitlines()) if x[:1] == "{"))
            for key, value in result.items():
                results[(engine, mode)].setdefault(key, []).append(value)
            print(
                f"run {i + 1} {engine} {mode}: one stream {result['one_stream_tok_s']:6.1f} "
                f"tok/s, batch {result['batch_output_tok_s']:6.1f} output tok/s",
                flush=True,
            )
    for (engine, mode), values in results.items():
        one = statistics.median(values["one_stream_tok_s"])
        batch = statistics.median(values["batch_output_tok_s"])
        print(f"median {engine} {mode}: one stream {one:6.1f} tok/s, batch {batch:6.1f} tok/s")


if __name__ == "__main__":
    main()
