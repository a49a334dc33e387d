"""What the machine can do: which dtype "auto" means here."""

from __future__ import annotations

import functools


@functools.cache
def cpu_has_native_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(dtype: str, hf_config, device: str) -> str:
    """vLLM's dtype rules, except that "auto" on a CPU without native bf16 is float32."""
    aliases = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp32": "float32"}
    dtype = aliases.get(dtype, dtype)
    if dtype == "auto":
        config_dtype = str(getattr(hf_config, "dtype", None) or "float32").replace("torch.", "")
        if device == "cpu":
            return "bfloat16" if cpu_has_native_bf16() and config_dtype == "bfloat16" else "float32"
        return "float16" if config_dtype == "float32" else config_dtype
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"Unsupported dtype {dtype!r}: use auto, float32, bfloat16 or float16.")
    return dtype
