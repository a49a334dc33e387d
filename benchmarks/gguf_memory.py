"""Memory of a GGUF model kept quantized (issue #15, acceptance 2): the file's tensor bytes,
the weight bytes the engine holds (``LLM.llm_engine.weight_memory_bytes``) and their ratio,
and the peak RSS of ``LLM()`` with quantization="gguf" and with "none" (every weight
dequantized to float32) at the same KV cache size. Each build runs in a fresh process (the
engine in it, enable_multiprocessing=False), so each peak is its own.

    .venv/bin/python benchmarks/gguf_memory.py                      # the bundled model
    .venv/bin/python benchmarks/gguf_memory.py --model /path/to/model.gguf
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys


def tensor_bytes(path: str) -> int:
    """Bytes of the file's tensor data, as the tensor table sizes them (no padding)."""
    import numpy as np
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    from minivllm.model.loader import read_gguf_header

    header = read_gguf_header(path)
    total = 0
    for name, shape in header.tensor_shapes.items():
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(header.tensor_data[name][0])]
        total += int(np.prod(shape, dtype=np.int64)) // block * size
    return total


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def child(args: argparse.Namespace) -> None:
    """Build LLM() once; print its memory as one JSON line."""
    from minivllm import LLM

    llm = LLM(
        model=args.model,
        quantization=args.child,
        enable_multiprocessing=False,
        max_model_len=args.max_model_len,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
    )
    engine = llm.llm_engine
    result = {
        "quantization": engine.quantization,
        "weight_memory_bytes": engine.weight_memory_bytes,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "rss_bytes": _status_kib("VmRSS") * 1024,
        "rss_anon_bytes": _status_kib("RssAnon") * 1024,
        "rss_file_bytes": _status_kib("RssFile") * 1024,
    }
    print("RESULT " + json.dumps(result), flush=True)


def measure(args: argparse.Namespace, quantization: str) -> dict:
    command = [sys.executable, __file__, "--child", quantization, "--model", args.model]
    command += ["--max-model-len", str(args.max_model_len)]
    command += ["--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    if done.returncode or not lines:
        raise RuntimeError(f"LLM(quantization={quantization!r}) failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="a .gguf file (default: the bundled one)")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=256 << 20)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.model is None:
        from minivllm.model.loader import default_model_path

        args.model = default_model_path()
    if args.child:
        child(args)
        return

    file_bytes = tensor_bytes(args.model)
    gguf = measure(args, "gguf")
    none = measure(args, "none")
    mb = 1e-6
    print(f"model: {args.model}")
    print(f"KV cache: {args.kv_cache_memory_bytes * mb:.0f} MB in both")
    print(f"tensor bytes in the file:        {file_bytes * mb:9.1f} MB")
    print(
        f"weights resident (gguf):         {gguf['weight_memory_bytes'] * mb:9.1f} MB  "
        f"= {gguf['weight_memory_bytes'] / file_bytes:.3f}x the file's tensors"
    )
    print(f"weights resident (none):         {none['weight_memory_bytes'] * mb:9.1f} MB")
    for name, r in (("gguf", gguf), ("none", none)):
        print(
            f"LLM() {name}: peak RSS {r['peak_rss_bytes'] * mb:8.1f} MB; after it "
            f"{r['rss_bytes'] * mb:.1f} MB (anonymous {r['rss_anon_bytes'] * mb:.1f}, "
            f"file-backed {r['rss_file_bytes'] * mb:.1f})"
        )
    print(f"peak RSS gguf / none: {gguf['peak_rss_bytes'] / none['peak_rss_bytes']:.3f}")
    print(json.dumps({"tensor_bytes": file_bytes, "gguf": gguf, "none": none}))


if __name__ == "__main__":
    main()
