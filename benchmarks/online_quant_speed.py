"""Speed of online quantization against the GGUF file of the same type and weights (issue
49, acceptance 4: each within 5%): one stream (`bench latency`, batch 1, 128 tokens in and
128 out: the median TPOT) and the standard throughput workload (`bench throughput`, 256 x
128 random tokens in, 128 out: output tokens/s). Each run is a fresh process and the two
sides alternate (online, file, online, file, ...) so that a slow spell of the machine falls
on both; the medians are printed and every run's JSON is kept under --out.

The float checkpoint is the bundled SmolLM2 as a float32 HF directory (prepare_model.py
writes it once). The GGUF of each type is written from those weights once: the bundled
file's metadata and tokenizer, each matrix quantized by gguf's reference quantizer (what
the online mode runs), the tied LM head in Q8_0 for the 4- and 5-bit types (as the online
mode keeps it), vectors in F32.

    .venv/bin/python benchmarks/online_quant_speed.py --modes q8_0,q4_1 --pairs 3

(q4_1 is the 4-bit mode the quality bar holds for on this directory, whose weights lie on a
Q4_1 grid; q4_0 runs as fast and may be asked for too.)

Keep the machine quiet while it runs: nothing else on its cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(__file__))

LATENCY = ["latency", "--input-len", "128", "--output-len", "128", "--batch-size", "1"]
LATENCY += ["--kv-cache-memory-bytes", str(1 << 30), "--max-model-len", "4096"]
LATENCY += ["--num-iters-warmup", "2", "--num-iters", "5"]
THROUGHPUT = ["throughput", "--input-len", "128", "--output-len", "128", "--num-prompts", "256"]
THROUGHPUT += ["--kv-cache-memory-bytes", str(4 << 30), "--no-enable-prefix-caching"]


def write_gguf_of_type(float_dir: str, mode: str, out: str) -> str:
    """The float directory's weights as a GGUF file of ``mode``'s type, laid out as the
    bundled file (its metadata, tokenizer and tensor order, llama.cpp's q/k row order)."""
    if os.path.exists(out):
        return out
    import gguf
    import torch

    from minivllm.model.layers.quantization.online import HEAD_TYPE, ONLINE_TYPES
    from minivllm.model.loader import default_model_path, iter_weights
    from minivllm.model.loader.gguf import hf_name

    reader = gguf.GGUFReader(default_model_path())
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    heads = {
        ".q_proj.": reader.get_field(f"{arch}.attention.head_count").contents(),
        ".k_proj.": reader.get_field(f"{arch}.attention.head_count_kv").contents(),
    }
    weights = dict(iter_weights(float_dir, torch.float32))
    writer = gguf.GGUFWriter(out + ".tmp", arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for tensor in reader.tensors:
        name = hf_name(tensor.name, arch)
        array = weights[name].numpy()
        count = next((n for part, n in heads.items() if part in name), None)
        if count is not None:  # llama.cpp's converter interleaves each head's rotary halves
            rows = array.shape[0]
            array = array.reshape(count, 2, rows // count // 2, -1).swapaxes(1, 2)
            array = array.reshape(rows, -1)
        if array.ndim != 2:
            writer.add_tensor(tensor.name, array)
            continue
        head = tensor.name in ("token_embd.weight", "output.weight") and mode != "q8_0"
        qtype = gguf.GGMLQuantizationType[HEAD_TYPE if head else ONLINE_TYPES[mode]]
        writer.add_tensor(tensor.name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.rename(out + ".tmp", out)
    return out


def bench(tag: str, out_dir: str, model: str, quantization: str, args: list[str]) -> dict:
    """One `minivllm bench` run in a fresh process; its JSON."""
    path = os.path.join(out_dir, f"{tag}.json")
    command = [sys.executable, "-m", "minivllm.entrypoints.cli", "bench", *args]
    command += ["--model", model, "--quantization", quantization, "--output-json", path]
    env = {**os.environ, "PYTHONPATH": ROOT}
    with open(os.path.join(out_dir, f"{tag}.log"), "w") as log:
        subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT, env=env)
    with open(path) as f:
        return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="a float HF directory (default: prepared)")
    parser.add_argument("--modes", default="q8_0,q4_1")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--out", default=f"/tmp/minivllm-online-quant-{time.strftime('%H%M')}")
    args = parser.parse_args()

    from prepare_model import prepare

    float_dir = args.model or prepare()
    os.makedirs(args.out, exist_ok=True)
    summary = {}
    for mode in args.modes.split(","):
        gguf_file = write_gguf_of_type(float_dir, mode, f"{float_dir}.{mode.upper()}.gguf")
        sides = {"online": (float_dir, mode), "gguf": (gguf_file, "gguf")}
        tpot: dict[str, list[float]] = {side: [] for side in sides}
        rate: dict[str, list[float]] = {side: [] for side in sides}
        for i in range(args.pairs):
            for side, (model, quantization) in sides.items():
                run = bench(f"{mode}-lat-{side}-{i}", args.out, model, quantization, LATENCY)
                tpot[side].append(run["median_tpot_ms"])
                print(f"{mode} {side} latency {i}: TPOT {run['median_tpot_ms']:.2f} ms", flush=True)
            for side, (model, quantization) in sides.items():
                run = bench(f"{mode}-tp-{side}-{i}", args.out, model, quantization, THROUGHPUT)
                rate[side].append(run["output_tokens_per_second"])
                print(f"{mode} {side} throughput {i}: {rate[side][-1]:.1f} tok/s", flush=True)
        medians = {
            "tpot_ms": {side: statistics.median(v) for side, v in tpot.items()},
            "output_tokens_per_s": {side: statistics.median(v) for side, v in rate.items()},
        }
        medians["tpot_ratio_online_to_gguf"] = (
            medians["tpot_ms"]["online"] / medians["tpot_ms"]["gguf"]
        )
        medians["throughput_ratio_online_to_gguf"] = (
            medians["output_tokens_per_s"]["online"] / medians["output_tokens_per_s"]["gguf"]
        )
        summary[mode] = medians
    print(json.dumps(summary, indent=2))
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
