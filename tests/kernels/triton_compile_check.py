"""Compiles the Triton attention kernels for a CUDA target down to a cubin, with no GPU:
what the interpreter never checks (types of loop-carried values, constexpr rules, tile
shapes the tensor cores take). Run as a script with TRITON_INTERPRET unset:

    python tests/kernels/triton_compile_check.py [sm] [--all]   # sm 90 (H100) by default
"""

from __future__ import annotations

import inspect
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from minivllm.kernels import triton_attention as ta

DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
DATA_POINTERS = ("out_ptr", "q_ptr", "k_cache_ptr", "v_cache_ptr", "k_ptr", "v_ptr")
FLOAT32_POINTERS = ("part_out_ptr", "part_max_ptr", "part_sum_ptr")


def signature(kernel, data_type: str, constexprs: dict) -> dict[str, str]:
    """The argument types the Python wrappers pass (pointers by name, ints, floats)."""
    types = {}
    for name, param in inspect.signature(kernel.fn).parameters.items():
        if name in constexprs:
            types[name] = "constexpr"
        elif name in DATA_POINTERS:
            types[name] = "*" + data_type
        elif name in FLOAT32_POINTERS:
            types[name] = "*fp32"
        elif name == "slot_mapping_ptr":
            types[name] = "*i64"
        elif name.endswith("_ptr"):
            types[name] = "*i32"
        elif name in ("scale", "soft_cap"):
            types[name] = "fp32"
        elif param.annotation == "tl.int64":
            types[name] = "i64"
        else:
            types[name] = "i32"
    return types


def attention_constexprs(
    dtype: str, group: int, head_dim: int, window: int, soft_cap: bool, splits: int
):
    block_m = max(16, triton.next_power_of_2(group))
    return dict(
        NUM_HEADS=2 * group,
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=16,
        BLOCK_Q=block_m // group,
        BLOCK_M=block_m,
        TILE=32,
        SLIDING_WINDOW=window,
        USE_SOFT_CAP=soft_cap,
        WIDEN=dtype == "float32",
        NUM_SPLITS=splits,
    )


# (group, head_dim, sliding window, soft-cap, kv splits): Qwen3-0.6B's and Llama-3.2-1B's
# shapes (GQA 2 and 4, head_dim 128 and 64), Gemma's window and cap with head_dim 256, an
# unpadded group of 32 and a padded head_dim; split-KV.
CASES = [
    (2, 128, 0, False, 1),
    (4, 64, 0, False, 8),
    (2, 256, 1024, True, 1),
    (32, 80, 0, False, 1),
]
ALL = [(dtype, case) for dtype in DTYPES for case in CASES]
# One of each dtype, each shape feature at least once.
QUICK = [("bfloat16", CASES[1]), ("float32", CASES[2]), ("float16", CASES[3])]


def main(sm: int, combinations) -> None:
    target = GPUTarget("cuda", sm, 32)
    for dtype in sorted({dtype for dtype, _ in combinations}):
        constexprs = dict(BLOCK_SIZE=16, ROW=1024, ROW_PADDED=1024)
        kernel = ta._reshape_and_cache_kernel
        source = ASTSource(kernel, signature(kernel, DTYPES[dtype], constexprs), constexprs)
        assert "cubin" in triton.compile(source, target=target).asm
    for dtype, case in combinations:
        constexprs = attention_constexprs(dtype, *case)
        kernel = ta._unified_attention_kernel
        source = ASTSource(kernel, signature(kernel, DTYPES[dtype], constexprs), constexprs)
        compiled = triton.compile(source, target=target)
        assert "cubin" in compiled.asm
        if constexprs["NUM_SPLITS"] > 1:
            merge = ta._merge_splits_kernel
            names = ("NUM_HEADS", "NUM_SPLITS", "HEAD_DIM", "HEAD_DIM_PADDED")
            constexprs = {name: constexprs[name] for name in names}
            source = ASTSource(merge, signature(merge, DTYPES[dtype], constexprs), constexprs)
            assert "cubin" in triton.compile(source, target=target).asm
        print(dtype, case, "compiled; shared memory", compiled.metadata.shared)


if __name__ == "__main__":
    assert not ta.INTERPRETED, "unset TRITON_INTERPRET: the interpreter compiles nothing"
    sm = int(sys.argv[1]) if len(sys.argv) > 1 else 90
    main(sm, ALL if "--all" in sys.argv else QUICK)
