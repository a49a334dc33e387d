"""Embedding throughput: one `LLM.embed` call over random prompts, or HF transformers' batched
forward on the same prompts (the floor), last-token pooling, L2-normalized.

The prompts are `minivllm bench throughput`'s (random token ids, seed 0, all of one length,
so HF needs no padding). Only the embedding call is timed, after a warm-up on 8 prompts.
The GGUF file is read by both: minivllm keeps its blocks (`--quantization gguf`, the
default for a .gguf) or dequantizes them (`none`); HF dequantizes it to float32.

    .venv/bin/python benchmarks/embed_throughput.py --engine minivllm [--model FILE]
    .venv/bin/python benchmarks/embed_throughput.py --engine hf --batch-size 32
    .venv/bin/python benchmarks/embed_throughput.py --engine llamacpp \
        --llama-embedding /work/llamacpp/build/bin/llama-embedding

llama.cpp (built by benchmarks/gguf_llamacpp.sh build, with the llama-embedding target)
reads the prompts as text, one a line: the random ids decoded, newlines made spaces, so it
re-tokenizes them (about 134 tokens each on SmolLM2 instead of 128); its rate counts the
tokens it reports (`batch_decode: n_tokens`) over the time from its first batch to its exit
(the model's load left out), with --llama-ubatch tokens (512: about 3 prompts) a batch.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
import time

import torch

from minivllm.bench.datasets import random_token_prompts
from minivllm.model.loader import default_model_path
from minivllm.tokenizer import load_tokenizer


def run_minivllm(args, prompts: list[list[int]]) -> float:
    from minivllm import LLM

    llm = LLM(args.model, runner="pooling", quantization=args.quantization)
    llm.embed([{"prompt_token_ids": p} for p in prompts[:8]], use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert len(outputs) == len(prompts)
    return elapsed


def run_hf(args, prompts: list[list[int]]) -> float:
    from transformers import AutoModel

    folder, name = os.path.split(args.model)
    model = AutoModel.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()

    def embed(batch: list[list[int]]) -> torch.Tensor:
        hidden = model(torch.tensor(batch)).last_hidden_state[:, -1]
        return torch.nn.functional.normalize(hidden, dim=-1)

    with torch.inference_mode():
        embed(prompts[:8])
        start = time.perf_counter()
        for i in range(0, len(prompts), args.batch_size):
            embed(prompts[i : i + args.batch_size])
        return time.perf_counter() - start


def run_llamacpp(args, prompts: list[list[int]]) -> tuple[float, int]:
    """(seconds, tokens) of llama-embedding on the prompts' text, last-token pooling."""
    tokenizer = load_tokenizer(args.model)
    lines = [tokenizer.decode(p).replace("\n", " ").replace("\r", " ") for p in prompts]
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
        f.write("\n".join(lines))
        f.flush()
        command = [args.llama_embedding, "-m", args.model, "-f", f.name, "--pooling", "last"]
        ubatch = str(args.llama_ubatch)
        command += ["--embd-normalize", "2", "-t", "2", "-c", "8192", "-b", ubatch, "-ub", ubatch]
        start = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, errors="replace", check=True)
        wall = time.perf_counter() - start
    # Its log lines start with the time since it started: minutes.seconds.ms.us.
    pattern = r"^(\d+)\.(\d+)\.(\d+)\.\d+ I batch_decode: n_tokens = (\d+)"
    batches = re.findall(pattern, done.stderr, re.M)
    minutes, seconds, millis, _ = batches[0]
    first = int(minutes) * 60 + int(seconds) + int(millis) / 1000
    return wall - first, sum(int(b[3]) for b in batches)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=["minivllm", "hf", "llamacpp"], required=True)
    parser.add_argument("--model", default=None, help="a .gguf file (default: the bundled one)")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--quantization", default=None, help="minivllm: gguf (default) or none")
    parser.add_argument("--batch-size", type=int, default=32, help="HF: prompts per forward")
    parser.add_argument("--llama-embedding", default=None, help="llama.cpp's binary")
    parser.add_argument("--llama-ubatch", type=int, default=512, help="llama.cpp: batch tokens")
    args = parser.parse_args()
    args.model = args.model or default_model_path()
    torch.set_num_threads(min(2, os.cpu_count() or 1))

    prompts = random_token_prompts(
        load_tokenizer(args.model), args.num_prompts, args.input_len, seed=0
    )
    tokens = args.num_prompts * args.input_len
    if args.engine == "llamacpp":
        elapsed, tokens = run_llamacpp(args, prompts)
    else:
        elapsed = (run_minivllm if args.engine == "minivllm" else run_hf)(args, prompts)
    print(
        f"{args.engine}: {args.num_prompts} prompts, {tokens} tokens in "
        f"{elapsed:.2f} s: {args.num_prompts / elapsed:.2f} requests/s, "
        f"{tokens / elapsed:.1f} prompt tokens/s"
    )


if __name__ == "__main__":
    main()
