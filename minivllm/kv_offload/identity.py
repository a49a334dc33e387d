"""The identity a disk cache file is keyed by: what decides a block's K/V besides its tokens
(the model's weights, dtype and quantization, the KV cache's dtype and block size, the
tensor-parallel split). Two processes of the same model on the machine get the same key;
any other model, dtype or layout another one."""

from __future__ import annotations

import hashlib
import logging
import os
from typing import TYPE_CHECKING, Any

from minivllm.config import KV_CACHE_DTYPE_ALIASES

if TYPE_CHECKING:
    from minivllm.config import ModelConfig
    from minivllm.engine.arg_utils import EngineArgs

logger = logging.getLogger(__name__)

_SAMPLE = 1 << 20  # bytes read from each end of a weights file
_WEIGHT_SUFFIXES = (".gguf", ".safetensors", ".bin", ".json")


def file_fingerprint(path: str) -> bytes:
    """A weights file's size and the sha256 of its first and last MiB: the file's content,
    cheaply (the whole file would take seconds at every start), wherever it lives."""
    size = os.path.getsize(path)
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        digest.update(f.read(_SAMPLE))
        if size > 2 * _SAMPLE:
            f.seek(size - _SAMPLE)
            digest.update(f.read(_SAMPLE))
    return digest.digest()


def model_fingerprint(model: str) -> bytes:
    """The fingerprint of a model file, or of a model folder's weight and config files."""
    if os.path.isfile(model):
        return file_fingerprint(model)
    digest = hashlib.sha256()
    for name in sorted(os.listdir(model)):
        path = os.path.join(model, name)
        if name.endswith(_WEIGHT_SUFFIXES) and os.path.isfile(path):
            digest.update(name.encode() + file_fingerprint(path))
    return digest.digest()


_EARLIER_LAYOUT_NAMES = {
    "int8k_int8v": "int8+smoothed-keys",
    "e4m3k_e4m3v": "fp8_e4m3",
    "e5m2k_e5m2v": "fp8_e5m2",
}


def identity_key(
    model: str,
    dtype: str,
    quantization: str | None,
    kv_cache_dtype: str,
    block_size: int,
    tensor_parallel_size: int,
) -> bytes:
    """32 bytes naming everything a cached block's bytes depend on besides its tokens."""
    # The layout an alias names (int8 is fp16k_int8v since issue 53's outlier fix, fp8
    # fp16k_e4m3v since its quality fix: older int8 and fp8 files are foreign); the layouts
    # those names stored before keep the names their files were keyed by. int8k_int8v's
    # keys were rotated (the old int8's files) and are smoothed since: a name of their own.
    kv_layout = KV_CACHE_DTYPE_ALIASES.get(kv_cache_dtype, kv_cache_dtype)
    kv_layout = _EARLIER_LAYOUT_NAMES.get(kv_layout, kv_layout)
    parts = (
        # 2: the CPU cache's value blocks head-major, [Hkv, block_size, D] (1's files hold
        # [block_size, Hkv, D] blocks).
        "minivllm-kv-disk-2",
        model_fingerprint(model).hex(),
        dtype,
        str(quantization),
        kv_layout,
        str(block_size),
        str(tensor_parallel_size),
    )
    return hashlib.sha256("\x00".join(parts).encode()).digest()


def disk_cache_fields(args: EngineArgs, model_config: ModelConfig) -> dict[str, Any]:
    """CacheConfig's kv_cache_disk* fields from the engine arguments (none without
    --kv-cache-disk, or when prefix caching is off or its hashes change between runs)."""
    if not args.kv_cache_disk:
        return {}
    if not args.enable_prefix_caching or args.prefix_caching_hash_algo != "sha256":
        logger.warning(
            "--kv-cache-disk is off: it needs prefix caching with sha256 block hashes (the "
            "builtin hash differs from one process to the next)."
        )
        return {}
    key = identity_key(
        model_config.model,
        model_config.dtype,
        model_config.quantization,
        args.kv_cache_dtype,
        args.block_size,
        args.tensor_parallel_size,
    )
    return {
        "kv_cache_disk": os.path.abspath(os.path.expanduser(args.kv_cache_disk)),
        "kv_cache_disk_bytes": int(args.kv_cache_disk_size * (1 << 30)),
        "kv_cache_disk_key": key.hex(),
        "kv_cache_disk_ranks": args.tensor_parallel_size,
    }
