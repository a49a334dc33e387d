"""Compiles the Triton attention and layer kernels for a CUDA target down to a cubin, with no GPU:
what the interpreter never checks (types of loop-carried values, constexpr rules, tile
shapes the tensor cores take), and whether ptxas spills registers with the launch
configuration the wrapper picks. Run as a script with TRITON_INTERPRET unset and a fresh
TRITON_CACHE_DIR (a cached kernel runs no ptxas, so reports no spills):

    python tests/kernels/triton_compile_check.py [sm] [--all]   # sm 90 (H100) by default

Prints one line per attention kernel: "<dtype> <case> compiled; spill bytes <n>", and one
per dtype for the layer kernels: "<dtype> layer kernels built; spill bytes <n>".
"""

from __future__ import annotations

import contextlib
import inspect
import io
import os
import re
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from minivllm.kernels import triton_attention as ta
from minivllm.kernels import triton_kv_cache as tkv
from minivllm.kernels import triton_layers as tly

DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
DATA_POINTERS = ("out_ptr", "q_ptr", "k_cache_ptr", "v_cache_ptr", "k_ptr", "v_ptr")
DATA_POINTERS += ("x_ptr", "residual_ptr", "weight_ptr")
FLOAT32_POINTERS = ("part_out_ptr", "part_max_ptr", "part_sum_ptr", "sinks_ptr")
FLOAT32_POINTERS += ("cos_ptr", "sin_ptr")


def signature(kernel, data_type: str, constexprs: dict) -> dict[str, str]:
    """The argument types the Python wrappers pass (pointers by name, ints, floats); a
    quantized cache (KV_TYPE > 0) is bytes."""
    types = {}
    for name, param in inspect.signature(kernel.fn).parameters.items():
        if name in constexprs:
            types[name] = "constexpr"
        elif name in ("k_cache_ptr", "v_cache_ptr") and constexprs.get("KV_TYPE", 0):
            types[name] = "*u8"
        elif name in DATA_POINTERS:
            types[name] = "*" + data_type
        elif name in FLOAT32_POINTERS:
            types[name] = "*fp32"
        elif name in ("slot_mapping_ptr", "positions_ptr"):
            types[name] = "*i64"
        elif name.endswith("_ptr"):
            types[name] = "*i32"
        elif name in ("scale", "soft_cap", "eps"):
            types[name] = "fp32"
        elif param.annotation == "tl.int64":
            types[name] = "i64"
        else:
            types[name] = "i32"
    return types


def attention_constexprs(
    dtype, group, head_dim, window, soft_cap, splits, max_query_len, sinks, kv_type=0
):
    """The constexprs (and warps) unified_attention launches with for such a batch."""
    head_dim_padded = max(16, triton.next_power_of_2(head_dim))
    block_m, tile, num_warps = ta.launch_config(
        getattr(torch, dtype), group, head_dim_padded, max_query_len, kv_type
    )
    constexprs = dict(
        NUM_HEADS=2 * group,
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=head_dim_padded,
        BLOCK_SIZE=16,
        BLOCK_Q=block_m // group,
        BLOCK_M=block_m,
        TILE=tile,
        SLIDING_WINDOW=window,
        USE_SOFT_CAP=soft_cap,
        USE_SINKS=sinks,
        WIDEN=dtype == "float32",
        NUM_SPLITS=splits,
        KV_TYPE=kv_type,
    )
    return constexprs, num_warps


# (group, head_dim, sliding window, soft-cap, kv splits, max_query_len, sinks): Qwen3-0.6B's
# and Llama-3.2-1B's shapes (GQA 2 and 4, head_dim 128 and 64), decodes and a long chunk;
# split-KV; Gemma's window and cap with head_dim 256; an unpadded group of 32 and a padded
# head_dim; gpt-oss's window and sinks (GQA 8), split.
CASES = [
    (2, 128, 0, False, 1, 1, False),
    (2, 128, 0, False, 1, 512, False),
    (4, 64, 0, False, 8, 1, False),
    (2, 256, 1024, True, 1, 512, False),
    (32, 80, 0, False, 1, 1, False),
    (8, 64, 128, False, 4, 1, True),
]
ALL = [(dtype, case) for dtype in DTYPES for case in CASES]
# One of each dtype, each shape feature at least once.
QUICK = [("bfloat16", CASES[1]), ("bfloat16", CASES[2]), ("float32", CASES[3])]
QUICK += [("float16", CASES[4]), ("bfloat16", CASES[5])]
# Quantized caches (--kv-cache-dtype): int8, fp8 and float16 keys with int8 or scaled fp8
# values on a decode and a long chunk.
QUANTIZED = [("bfloat16", CASES[2] + (1,)), ("bfloat16", CASES[1] + (2,))]
QUANTIZED += [("float16", CASES[0] + (3,)), ("bfloat16", CASES[3] + (1,))]
QUANTIZED += [("bfloat16", CASES[2] + (4,)), ("bfloat16", CASES[2] + (5,))]
QUANTIZED += [("bfloat16", CASES[1] + (6,))]
ALL += QUANTIZED
QUICK += QUANTIZED


def compile_kernel(
    kernel, dtype: str, constexprs: dict, target, num_warps: int = 4, options: dict | None = None
) -> int:
    """Compiles to a cubin; returns ptxas' spill-store bytes (-1 when it printed none)."""
    source = ASTSource(kernel, signature(kernel, DTYPES[dtype], constexprs), constexprs)
    log = io.StringIO()
    options = {"num_warps": num_warps, **(options or {})}
    with contextlib.redirect_stdout(log):  # TRITON_DUMP_PTXAS_LOG=1 prints ptxas -v
        compiled = triton.compile(source, target=target, options=options)
    assert "cubin" in compiled.asm
    spills = re.findall(r"(\d+) bytes spill stores", log.getvalue())
    return max(map(int, spills)) if spills else -1


def main(sm: int, combinations) -> None:
    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"
    target = GPUTarget("cuda", sm, 32)
    for dtype in sorted({dtype for dtype, _ in combinations}):
        constexprs = dict(BLOCK_SIZE=16, ROW=1024, ROW_PADDED=1024)
        compile_kernel(tkv._reshape_and_cache_kernel, dtype, constexprs, target)
        for kv_type in (1, 2, 3, 4, 5, 6):
            quantized = dict(BLOCK_SIZE=16, NUM_KV_HEADS=8, HEAD_DIM=128, HKV_P=8, D_P=128)
            quantized["KV_TYPE"] = kv_type
            compile_kernel(tkv._reshape_and_cache_quantized_kernel, dtype, quantized, target)
    seen = {}  # a configuration compiled twice comes from the cache, without ptxas' log
    for dtype, case in combinations:
        constexprs, num_warps = attention_constexprs(dtype, *case)
        key = (dtype, num_warps, tuple(sorted(constexprs.items())))
        if key not in seen:
            kernel = ta._unified_attention_kernel
            seen[key] = compile_kernel(kernel, dtype, constexprs, target, num_warps)
        spills = seen[key]
        if constexprs["NUM_SPLITS"] > 1:
            names = ("NUM_HEADS", "NUM_SPLITS", "HEAD_DIM", "HEAD_DIM_PADDED")
            merge = {name: constexprs[name] for name in names}
            compile_kernel(ta._merge_splits_kernel, dtype, merge, target)
        print(dtype, case, "compiled; spill bytes", spills)
    for dtype in sorted({dtype for dtype, _ in combinations}):
        print(dtype, "layer kernels built; spill bytes", compile_layer_kernels(dtype, target))
        if dtype != "float32":
            print(dtype, "small-M linear built; spill bytes", compile_linear(dtype, target))


def compile_linear(dtype: str, target) -> int:
    """The small-M product, whole and split over K (fp32 partial sums, then their sum)."""
    from minivllm.kernels import triton_linear as tli

    t = DTYPES[dtype]
    spills = []
    for split in (False, True):
        constexprs = dict(
            BLOCK_M=tli.MAX_ROWS, BLOCK_N=tli.BLOCK_N, BLOCK_K=tli.BLOCK_K, SPLIT=split
        )
        kernel = tli._small_m_linear_kernel
        types = {name: "i32" for name in inspect.signature(kernel.fn).parameters}
        types.update(x_ptr="*" + t, w_ptr="*" + t, out_ptr="*fp32" if split else "*" + t)
        types.update({name: "constexpr" for name in constexprs})
        source = ASTSource(kernel, types, constexprs)
        log = io.StringIO()
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(source, target=target, options={"num_warps": 4})
        assert "cubin" in compiled.asm
        found = re.findall(r"(\d+) bytes spill stores", log.getvalue())
        spills.append(max(map(int, found)) if found else -1)
    constexprs = dict(SPLIT_K=4, BLOCK=1024)
    types = dict(partial_ptr="*fp32", out_ptr="*" + t, MN="i32", SPLIT_K="constexpr")
    types["BLOCK"] = "constexpr"
    compiled = triton.compile(ASTSource(tli._sum_splits_kernel, types, constexprs), target=target)
    assert "cubin" in compiled.asm
    return max(spills)


def compile_layer_kernels(dtype: str, target) -> int:
    """The RMS norm (Llama-3.2-1B's width, with and without the residual; Qwen3's heads),
    SiLU-and-mul and rotary (Llama 3.2's 32 heads of 64) kernels, as the wrappers launch
    them; returns the largest spill."""
    launches = [
        (tly._rms_norm_kernel, dict(N=2048, BLOCK=2048, HAS_RESIDUAL=True), 4),
        (tly._rms_norm_kernel, dict(N=128, BLOCK=128, HAS_RESIDUAL=False), 4),
        (tly._rms_norm_kernel, dict(N=8192, BLOCK=8192, HAS_RESIDUAL=True), 8),
        (tly._silu_and_mul_kernel, dict(D=8192, BLOCK=1024), 4),
        (tly._rotary_kernel, dict(HALF=32, BLOCK_H=32, BLOCK_D=32), 4),
    ]
    return max(
        compile_kernel(kernel, dtype, constexprs, target, warps, tly.EXACT)
        for kernel, constexprs, warps in launches
    )


if __name__ == "__main__":
    assert not ta.INTERPRETED, "unset TRITON_INTERPRET: the interpreter compiles nothing"
    sm = int(sys.argv[1]) if len(sys.argv) > 1 else 90
    main(sm, ALL if "--all" in sys.argv else QUICK)
