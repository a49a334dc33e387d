"""minivllm on one GPU, each figure beside its bound, against HF transformers' `generate`.

Measures, in one process and one sitting:

- the device's two bounds: device-to-device copy bandwidth (bytes read + written) and the
  bf16 8192^3 matrix product rate;
- `decode`: one stream's decode rate (128 random tokens in, TPOT from 1 and N outputs, as
  compare_vllm.py's latency), against weight bytes / bandwidth;
- `standard`: the standard throughput workload (`minivllm bench throughput`: 256 prompts x
  128 random tokens in, 128 out, temperature 1, ignore_eos, one generate call);
- `nano`: nano-vllm's bench.py (256 sequences, input and output lengths uniform in
  100-1024, token ids in [0, 10000], temperature 0.6, ignore_eos, output tokens/s);

for minivllm with CUDA graphs on and off (`nano` with graphs on only), and HF transformers'
batched `generate` (left padding, every sequence of a batch generating the batch's largest
output length, with only each sequence's own length counted: the tokens the workload asks
for). The throughput bounds are max(FLOPs / matrix rate, bytes / bandwidth), where the
bytes are the weights once per decode step of the longest request plus each output token's
read of its context's KV cache: no schedule can beat either.

The model is a random-weight checkpoint with Qwen3-0.6B's shape, in bf16
(gpu_checkpoints.py), written on first use. Prints a JSON object and the markdown lines for
BENCHMARKS.md, and writes the JSON to --out (default $OUT, else the current folder).

    python benchmarks/gpu_bench.py decode standard nano --kv-cache-gib 40   # the device run
    python benchmarks/gpu_bench.py --tiny decode standard nano   # on a CPU, to debug this
    python benchmarks/gpu_bench.py --report a.json b.json   # the markdown of earlier runs
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_checkpoints  # noqa: E402

MODEL = "qwen3-0.6b"
WORKLOADS = ("decode", "standard", "nano")


# ----------------------------------------------------------------------------- workloads


def standard_workload(tokenizer, tiny: bool) -> dict:
    from minivllm.bench.datasets import random_token_prompts

    num, length = (8, 16) if tiny else (256, 128)
    prompts = random_token_prompts(tokenizer, num, length, seed=0)
    return {"prompts": prompts, "output_lens": [length] * num, "temperature": 1.0}


def nano_workload(vocab_size: int, tiny: bool) -> dict:
    """nano-vllm's bench.py, draw for draw (Python's random, seed 0)."""
    num, low, high = (8, 10, 40) if tiny else (256, 100, 1024)
    max_id = min(10000, vocab_size - 3)  # the tiny vocabulary is smaller
    random.seed(0)
    prompts = [
        [random.randint(0, max_id) for _ in range(random.randint(low, high))] for _ in range(num)
    ]
    output_lens = [random.randint(low, high) for _ in range(num)]
    # nano-vllm's README counts 133,966 output tokens (1,434 tok/s in 93.41 s): same draws.
    assert tiny or sum(output_lens) == 133_966, sum(output_lens)
    return {"prompts": prompts, "output_lens": output_lens, "temperature": 0.6}


def workload_floor(config: dict, wl: dict, bounds: dict, dtype_bytes: int) -> dict:
    """The least time any engine needs: FLOPs over the matrix rate, bytes over bandwidth."""
    h, layers = config["hidden_size"], config["num_hidden_layers"]
    attn_width = config["num_attention_heads"] * config["head_dim"]
    linear = gpu_checkpoints.weight_bytes(config, 1) - config["vocab_size"] * h  # parameters
    kv_token = gpu_checkpoints.kv_bytes_per_token(config, dtype_bytes)
    flops = bytes_ = 0
    for prompt, out in zip(wl["prompts"], wl["output_lens"]):
        n_in, total = len(prompt), len(prompt) + out
        flops += 2 * linear * (total - 1) + 2 * config["vocab_size"] * h * out
        flops += 4 * attn_width * layers * (total - 1) * total // 2  # QK^T and PV, causal
        bytes_ += kv_token * sum(range(n_in, total))  # each output token reads its context
    bytes_ += gpu_checkpoints.weight_bytes(config, dtype_bytes) * max(wl["output_lens"])
    compute_s = flops / (bounds["matmul_tflops"] * 1e12)
    memory_s = bytes_ / (bounds["copy_gbps"] * 1e9)
    floor_s = max(compute_s, memory_s)
    return {
        "tflop": flops / 1e12,
        "gbytes": bytes_ / 1e9,
        "floor_s": floor_s,
        "bound_output_tok_s": sum(wl["output_lens"]) / floor_s,
    }


# ----------------------------------------------------------------------------- the bounds


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str, iters: int) -> float:
    """Median seconds of fn() over iters runs, after three warm-ups."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_bounds(device: str, tiny: bool) -> dict:
    nbytes = (64 << 20) if tiny else (4 << 30)
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_s = timed(functools.partial(dst.copy_, src), device, 10)
    del src, dst
    n, dtype = (512, torch.float32) if tiny else (8192, torch.bfloat16)
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    mm_s = timed(functools.partial(torch.matmul, a, b), device, 10)
    del a, b
    if device == "cuda":
        torch.cuda.empty_cache()
    return {
        "copy_gbps": 2 * nbytes / copy_s / 1e9,
        "matmul_tflops": 2 * n**3 / mm_s / 1e12,
        "matmul": f"{n}^3 {str(dtype).removeprefix('torch.')}",
    }


# ----------------------------------------------------------------------------- minivllm


def make_llm(folder: str, args, graphs: bool, **extra):
    from minivllm import LLM

    kwargs = dict(
        extra,
        device=args.device,
        dtype=args.dtype,
        max_model_len=4096 if not args.tiny else 256,
        enable_prefix_caching=False,  # the prompts repeat across runs (BENCHMARKING.md)
        enforce_eager=not graphs,
    )
    if args.kv_cache_gib:
        kwargs["kv_cache_memory_bytes"] = int(args.kv_cache_gib * (1 << 30))
    return LLM(folder, **kwargs)


def minivllm_decode(llm, prompt: list[int], n: int, repeats: int) -> list[float]:
    """Tokens/s of one stream: 1 / TPOT, TPOT = (E2E(n) - E2E(1)) / (n - 1)."""
    from minivllm import SamplingParams

    def e2e(max_tokens: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        return time.perf_counter() - start

    e2e(n)  # warm-up
    return [(n - 1) / (e2e(n) - e2e(1)) for _ in range(repeats)]


def minivllm_throughput(llm, wl: dict, repeats: int) -> list[float]:
    from minivllm import SamplingParams

    prompts = [{"prompt_token_ids": p} for p in wl["prompts"]]
    params = [
        SamplingParams(temperature=wl["temperature"], top_p=1.0, ignore_eos=True, max_tokens=n)
        for n in wl["output_lens"]
    ]
    warm = SamplingParams(max_tokens=2)
    llm.generate([{"prompt_token_ids": wl["prompts"][0][:16]}], warm, use_tqdm=False)
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        produced = [len(o.outputs[0].token_ids) for o in outputs]
        assert produced == wl["output_lens"], "ignore_eos: every request runs to max_tokens"
        rates.append(sum(produced) / elapsed)
    return rates


# ----------------------------------------------------------------------------- HF


def hf_throughput(model, wl: dict, args, pad_id: int, batch_size: int) -> dict:
    """HF's batched generate: left padding, each batch to its largest output length."""
    prompts, lens = wl["prompts"], wl["output_lens"]
    limit = args.hf_max_prompts or len(prompts)
    prompts, lens = prompts[:limit], lens[:limit]
    sample = dict(do_sample=True, temperature=wl["temperature"], top_k=0, top_p=1.0)

    def generate(batch: list[list[int]], n: int) -> None:
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch], device=args.device)
        mask = torch.tensor(
            [[0] * (width - len(p)) + [1] * len(p) for p in batch], device=args.device
        )
        with torch.inference_mode():
            out = model.generate(
                ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                pad_token_id=pad_id, **sample,
            )  # fmt: skip
        assert out.shape[1] == width + n

    generate([prompts[0][:16]], 2)  # warm-up
    sync(args.device)
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        generate(prompts[i : i + batch_size], max(lens[i : i + batch_size]))
    sync(args.device)
    elapsed = time.perf_counter() - start
    return {
        "output_tok_s": sum(lens) / elapsed,
        "prompts": limit,
        "of": len(wl["prompts"]),
        "batch_size": min(batch_size, limit),
        "elapsed_s": elapsed,
    }


# ----------------------------------------------------------------------------- report


def entry(name: str, rates: list[float], bound: float, **extra) -> dict:
    median = statistics.median(rates)
    return {"name": name, "runs": rates, "median": median, "bound": bound,
            "of_bound": median / bound, **extra}  # fmt: skip


def markdown(result: dict) -> str:
    b = result["bounds"]
    lines = [
        f"{result['device']}, {result['date']}, commit {result.get('commit') or '?'}; "
        f"{result['model']} random weights, {result['dtype']}; torch {result['torch']}. "
        f"Bounds measured there: copy {b['copy_gbps']:.4g} GB/s (read + write), "
        f"{b['matmul']} matmul {b['matmul_tflops']:.4g} TFLOP/s.",
        "",
        "| figure | runs | median | bound | of bound |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for e in result["entries"]:
        runs = ", ".join(f"{r:.0f}" for r in e["runs"])
        name = e["name"]
        if "batch_size" in e:  # HF: say what it ran
            name += f" ({e['prompts']} of {e['of']} prompts, batches of {e['batch_size']})"
        lines.append(
            f"| {name} | {runs} | **{e['median']:.0f}** | {e['bound']:.0f} | "
            f"{100 * e['of_bound']:.0f}% |"
        )
    lines.append("")
    by_name = {e["name"]: e["median"] for e in result["entries"]}
    for wl in ("standard", "nano"):
        ours, hf = by_name.get(f"{wl}: minivllm, graphs on"), by_name.get(f"{wl}: HF generate")
        if ours and hf:
            lines.append(f"{wl}: minivllm / HF generate = **{ours / hf:.1f}x**")
    for wl in ("decode", "standard"):
        on, off = by_name.get(f"{wl}: minivllm, graphs on"), by_name.get(f"{wl}: minivllm, eager")
        if on and off:
            lines.append(f"{wl}: CUDA graphs on / off = **{on / off:.2f}x**")
        asynchronous = by_name.get(f"{wl}: minivllm, graphs on, async scheduling")
        if on and asynchronous:
            lines.append(f"{wl}: async scheduling on / off = **{asynchronous / on:.2f}x**")
    return "\n".join(lines)


def git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        )
    except OSError:
        return None
    return out.stdout.strip() or None


def report(paths: list[str]) -> None:
    for path in paths:
        with open(path) as f:
            result = json.load(f)
        result["commit"] = result.get("commit") or git_commit()
        print(markdown(result) + "\n")


# ----------------------------------------------------------------------------- main


def run(args) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype_bytes = torch.empty(0, dtype=getattr(torch, args.dtype)).element_size()
    folder = gpu_checkpoints.write_checkpoint(MODEL, args.dtype, args.checkpoints, args.tiny)
    config = gpu_checkpoints.model_config(MODEL, args.tiny)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    bounds = measure_bounds(args.device, args.tiny)
    print("bounds:", json.dumps(bounds), flush=True)
    loads = {}
    if "standard" in args.workloads:
        loads["standard"] = standard_workload(tokenizer, args.tiny)
    if "nano" in args.workloads:
        loads["nano"] = nano_workload(config["vocab_size"], args.tiny)
    floors = {wl: workload_floor(config, loads[wl], bounds, dtype_bytes) for wl in loads}
    decode_bound = bounds["copy_gbps"] * 1e9 / gpu_checkpoints.weight_bytes(config, dtype_bytes)
    decode_prompt = loads.get("standard", standard_workload(tokenizer, args.tiny))["prompts"][0]
    decode_tokens = 32 if args.tiny else args.decode_tokens

    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    result = {
        "device": device_name + (" (--tiny)" if args.tiny else ""),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": git_commit(),
        "torch": torch.__version__,
        "model": MODEL + ("-tiny" if args.tiny else ""),
        "dtype": args.dtype,
        "weight_bytes": gpu_checkpoints.weight_bytes(config, dtype_bytes),
        "bounds": bounds,
        "floors": floors,
        "entries": [],
    }
    name = "gpu_bench-" + "-".join(args.workloads) + ("-tiny" if args.tiny else "") + ".json"
    os.makedirs(args.out, exist_ok=True)

    def add(e: dict) -> None:
        """Keep every figure as it comes: a run cut off at its time limit keeps the rest."""
        result["entries"].append(e)
        print(json.dumps(e), flush=True)
        with open(os.path.join(args.out, name), "w") as f:
            json.dump(result, f, indent=1)

    def minivllm(graphs: bool, async_scheduling: bool = False) -> None:
        label = ("graphs on" if graphs else "eager") + (", async scheduling" * async_scheduling)
        # nano only with graphs on and sync (or async alone): the others say what graphs and
        # async buy.
        first = graphs and (args.async_only or not async_scheduling)
        wanted = [w for w in args.workloads if first or w != "nano"]
        start = time.perf_counter()
        llm = make_llm(folder, args, graphs, async_scheduling=async_scheduling)
        print(f"minivllm ({label}) started in {time.perf_counter() - start:.1f} s", flush=True)
        try:
            if "decode" in wanted:
                rates = minivllm_decode(llm, decode_prompt, decode_tokens, args.repeats)
                add(entry(f"decode: minivllm, {label}", rates, decode_bound))
            for wl in ("standard", "nano"):
                if wl in wanted:
                    repeats = args.repeats if wl == "standard" else args.nano_repeats
                    rates = minivllm_throughput(llm, loads[wl], repeats)
                    add(entry(f"{wl}: minivllm, {label}", rates, floors[wl]["bound_output_tok_s"]))
        finally:
            llm.llm_engine.shutdown()
            del llm
            gc.collect()

    def dummy_decode(model: str) -> None:
        """One stream on another shape, its weights drawn on the card (load_format="dummy"):
        the larger the model, the more of a step is weight reads and the less is launches."""
        folder = gpu_checkpoints.write_config(model, args.dtype, args.checkpoints, args.tiny)
        config = gpu_checkpoints.model_config(model, args.tiny)
        bound = bounds["copy_gbps"] * 1e9 / gpu_checkpoints.weight_bytes(config, dtype_bytes)
        rng = random.Random(0)  # ids every vocabulary here has (the tiny one: 2,048)
        prompt = [rng.randrange(min(10_000, config["vocab_size"] - 3)) for _ in decode_prompt]
        llm = make_llm(
            folder, args, graphs=True, load_format="dummy", async_scheduling=args.async_scheduling
        )
        label = "graphs on" + (", async scheduling" if args.async_scheduling else "")
        try:
            rates = minivllm_decode(llm, prompt, decode_tokens, args.repeats)
            add(entry(f"decode, {model} (dummy weights): minivllm, {label}", rates, bound))
        finally:
            llm.llm_engine.shutdown()
            del llm
            gc.collect()

    def hf() -> None:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, args.dtype))
        model = model.to(args.device).eval()
        for wl, load in loads.items():
            batch_size = args.hf_batch_size
            while True:
                try:
                    figures = hf_throughput(model, load, args, tokenizer.eos_token_id, batch_size)
                    break
                except torch.OutOfMemoryError:
                    gc.collect()
                    torch.cuda.empty_cache()
                    print(f"HF generate: out of memory at batch {batch_size}", flush=True)
                    batch_size //= 2
            rate, bound = figures.pop("output_tok_s"), floors[wl]["bound_output_tok_s"]
            add(entry(f"{wl}: HF generate", [rate], bound, **figures))
        del model
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()

    def guarded(fn, *fn_args, **fn_kwargs) -> None:
        """One group of figures; its failure is printed and the next group runs (device
        time is scarce: a crash in one mode must not cost the others' figures)."""
        try:
            fn(*fn_args, **fn_kwargs)
        except Exception:
            traceback.print_exc()
            print(f"FAILED: {fn.__name__}{fn_args}{fn_kwargs}", flush=True)
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()

    # Most wanted first, so a run cut off at the device's time limit loses the least:
    # graphs on, with async scheduling, other shapes' decode, the peer, then eager (which
    # runs no nano: it only says what graphs buy).
    if "on" in args.graphs and args.async_only:
        guarded(minivllm, graphs=True, async_scheduling=True)
        if "decode" in args.workloads:
            for model in args.decode_models:
                guarded(dummy_decode, model)
    elif "on" in args.graphs:
        guarded(minivllm, graphs=True)
        if args.async_scheduling and set(args.workloads) - {"nano"}:
            guarded(minivllm, graphs=True, async_scheduling=True)
        if "decode" in args.workloads:
            for model in args.decode_models:
                guarded(dummy_decode, model)
    if args.hf and loads:
        guarded(hf)
    if "off" in args.graphs and set(args.workloads) - {"nano"}:
        guarded(minivllm, graphs=False)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workloads", nargs="*", help=", ".join(WORKLOADS))
    parser.add_argument("--report", nargs="+", metavar="JSON", help="print these runs' markdown")
    parser.add_argument("--tiny", action="store_true", help="CPU, float32, tiny model and loads")
    parser.add_argument("--graphs", nargs="+", default=["on", "off"], choices=["on", "off"])
    parser.add_argument("--repeats", type=int, default=3, help="runs of decode and standard")
    parser.add_argument("--nano-repeats", type=int, default=1)
    parser.add_argument("--decode-tokens", type=int, default=512, help="one stream's output")
    parser.add_argument(
        "--decode-models",
        nargs="*",
        default=[],
        choices=sorted(set(gpu_checkpoints.MODELS) - {MODEL}),
        help="one stream on these shapes too (graphs on, random weights drawn on the device)",
    )
    parser.add_argument(
        "--async-scheduling",
        action="store_true",
        help="decode and standard again with async scheduling; the --decode-models with it",
    )
    parser.add_argument(
        "--async-only",
        action="store_true",
        help="graphs on with async scheduling only (CUDA's default), every workload",
    )
    parser.add_argument("--no-hf", dest="hf", action="store_false", help="minivllm only")
    parser.add_argument("--hf-batch-size", type=int, default=256)
    parser.add_argument(
        "--hf-max-prompts", type=int, default=None, help="HF on the first N prompts only"
    )
    parser.add_argument("--kv-cache-gib", type=float, default=None, help="else the engine's")
    parser.add_argument("--checkpoints", default=gpu_checkpoints.DEFAULT_OUT)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    if args.report:
        return report(args.report)
    if not args.workloads or not set(args.workloads) <= set(WORKLOADS):
        parser.error(f"name workloads among {', '.join(WORKLOADS)}")
    args.device = "cpu" if args.tiny else "cuda"
    args.dtype = "float32" if args.tiny else "bfloat16"
    args.async_scheduling = args.async_scheduling or args.async_only
    result = run(args)
    print(json.dumps(result))
    print("\n" + markdown(result))


if __name__ == "__main__":
    main()
