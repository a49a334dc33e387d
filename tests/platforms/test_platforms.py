"""The platform is chosen from ``device`` ("auto": CUDA when torch sees a GPU) and owns the
device's rules: dtypes, the attention backend, the KV cache's size, the collectives."""

from __future__ import annotations

import os
import types

import pytest
import torch

from minivllm.config import CacheConfig
from minivllm.platforms import cpu as cpu_module
from minivllm.platforms import get_platform
from minivllm.platforms.cpu import CpuPlatform, cpu_model_name
from minivllm.platforms.cuda import CudaPlatform


@pytest.mark.parametrize("cuda_present, expected", [(True, CudaPlatform), (False, CpuPlatform)])
def test_auto_picks_cuda_only_when_torch_sees_a_gpu(monkeypatch, cuda_present, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda_present)
    assert type(get_platform("auto")) is expected
    assert type(get_platform()) is expected


def test_an_explicit_device_ignores_what_torch_sees(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert type(get_platform("cpu")) is CpuPlatform
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert type(get_platform("cuda")) is CudaPlatform


def test_one_instance_per_kind():
    assert get_platform("cpu") is get_platform("cpu")


def test_an_unknown_device_is_refused():
    with pytest.raises(ValueError, match="device must be one of auto, cpu, cuda"):
        get_platform("tpu")


def test_what_each_platform_names():
    cpu, cuda = get_platform("cpu"), get_platform("cuda")
    assert (cpu.device, cpu.dist_backend, cpu.ray_actor_options()) == (
        torch.device("cpu"),
        "gloo",
        {"num_cpus": 1},
    )
    assert (cuda.device, cuda.dist_backend, cuda.ray_actor_options()) == (
        torch.device("cuda"),
        "nccl",
        {"num_gpus": 1},
    )
    assert "gguf" in cpu.supported_quantization and "gguf" not in cuda.supported_quantization


def config(dtype):
    return types.SimpleNamespace(dtype=dtype)


@pytest.mark.parametrize("native_bf16", [True, False])
@pytest.mark.parametrize(
    "config_dtype", [None, "float32", "bfloat16", torch.bfloat16, "float16", torch.float16]
)
def test_auto_dtype_on_cpu(monkeypatch, native_bf16, config_dtype):
    """bfloat16 checkpoints stay bfloat16 where the CPU computes it natively; all else is
    float32 (a CPU has no fast float16)."""
    monkeypatch.setattr(cpu_module, "cpu_has_native_bf16", lambda: native_bf16)
    bf16 = native_bf16 and str(config_dtype).endswith("bfloat16")
    assert CpuPlatform().resolve_dtype("auto", config(config_dtype)) == (
        "bfloat16" if bf16 else "float32"
    )


@pytest.mark.parametrize(
    "config_dtype, expected",
    [
        (None, "bfloat16"),
        ("float32", "bfloat16"),
        ("bfloat16", "bfloat16"),
        (torch.bfloat16, "bfloat16"),
        ("float16", "float16"),
        (torch.float16, "float16"),
    ],
)
def test_auto_dtype_on_cuda_follows_vllm(monkeypatch, config_dtype, expected):
    """bfloat16, except that a float16 checkpoint stays float16."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation: True)
    assert CudaPlatform().resolve_dtype("auto", config(config_dtype)) == expected


@pytest.mark.parametrize("config_dtype", [None, "float32", "bfloat16", "float16"])
def test_auto_dtype_on_a_gpu_without_bf16_is_float16(monkeypatch, config_dtype):
    # Only native bf16 counts: emulated bf16 on a pre-Ampere card is no reason to use it.
    monkeypatch.setattr(
        torch.cuda, "is_bf16_supported", lambda including_emulation: including_emulation
    )
    assert CudaPlatform().resolve_dtype("auto", config(config_dtype)) == "float16"


@pytest.mark.parametrize("platform", [CpuPlatform(), CudaPlatform()], ids=["cpu", "cuda"])
def test_explicit_dtypes_and_aliases(platform):
    for name, expected in [
        ("half", "float16"),
        ("float", "float32"),
        ("bf16", "bfloat16"),
        ("fp32", "float32"),
        ("bfloat16", "bfloat16"),
    ]:
        assert platform.resolve_dtype(name, config("float32")) == expected
    with pytest.raises(ValueError, match="Unsupported dtype 'int8'"):
        platform.resolve_dtype("int8", config("float32"))


def no_profiling() -> int:
    raise AssertionError("a given KV cache size needs no profiling pass")


def test_cpu_kv_cache_size_given_or_from_the_environment(monkeypatch):
    monkeypatch.setenv("MINIVLLM_CPU_KVCACHE_SPACE", "0.25")
    cpu = CpuPlatform()
    assert cpu.default_kv_cache_memory_bytes() == 1 << 28
    given = CacheConfig(kv_cache_memory_bytes=1 << 20)
    assert cpu.available_kv_cache_memory(given, no_profiling, 1) == 1 << 20
    assert cpu.available_kv_cache_memory(CacheConfig(), no_profiling, 1) == 1 << 28


def test_cuda_kv_cache_size_given_needs_no_profiling_pass():
    cuda = CudaPlatform()
    assert cuda.default_kv_cache_memory_bytes() is None  # measured at start-up
    given = CacheConfig(kv_cache_memory_bytes=1 << 20)
    assert cuda.available_kv_cache_memory(given, no_profiling, 1) == 1 << 20


def test_the_cpu_attention_backend_and_the_cuda_one_by_name():
    from minivllm.attention.cpu import CPUAttentionBackend

    assert get_platform("cpu").get_attn_backend_cls() is CPUAttentionBackend
    backend = get_platform("cpu").create_attn_backend(32)
    assert isinstance(backend, CPUAttentionBackend) and backend.block_size == 32
    assert get_platform("cuda").attn_backend == "minivllm.attention.triton.TritonAttentionBackend"


def test_the_cpu_model_name_comes_from_cpuinfo(tmp_path):
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nmodel name\t: AMD EPYC 9654 96-Core Processor\nflags\t: sse\n")
    assert cpu_model_name(str(x86)) == "AMD EPYC 9654 96-Core Processor"
    arm = tmp_path / "arm"  # no model name: the architecture
    arm.write_text("processor\t: 0\nBogoMIPS\t: 50.00\nCPU part\t: 0xd0c\n")
    assert cpu_model_name(str(arm)).endswith(" CPU")
    assert cpu_model_name(str(tmp_path / "missing")) == cpu_model_name(str(arm))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_argmax_is_torchs(dtype):
    """The CPU's greedy draw (numpy's argmax for float32) picks what torch's argmax picks:
    the first of tied maxima, the first NaN, a row of -inf's first index, strided rows."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 1000, generator=g).to(dtype)
    logits[1, [7, 500, 999]] = 9.0  # ties
    logits[2, [30, 40]] = float("nan")
    logits[3] = float("-inf")
    logits[4, 999] = float("inf")
    logits[5] = logits[5].round()  # many ties at the top
    platform = CpuPlatform()
    for rows in (logits, logits[:, ::3], logits[::2]):
        ids = platform.argmax(rows)
        assert ids.dtype == torch.int64
        assert ids.tolist() == rows.argmax(dim=-1).tolist()


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_the_cpu_kv_cache_is_zero_and_resident_only_where_written():
    """The KV cache's memory comes zeroed from the kernel on first touch: allocating 1 GiB
    writes nothing (torch.zeros wrote every page: a second of start-up per 4 GiB, all of it
    resident), and the blocks written become resident alone."""
    platform = CpuPlatform()
    before = _resident_bytes()
    cache = platform.zeros((2, 1024, 16, 4, 1024), torch.float32)  # 1 GiB
    assert cache.shape == (2, 1024, 16, 4, 1024) and cache.dtype == torch.float32
    assert cache.data_ptr() % 4096 == 0
    assert _resident_bytes() - before < (64 << 20)
    assert not cache[:, ::97].any()  # reads see zeros (and map no memory of their own)
    cache[1, 5] = 1.0
    assert _resident_bytes() - before < (64 << 20)
    assert cache.sum() == 16 * 4 * 1024 and cache[1, 5].all()
    assert platform.zeros((0, 3), torch.bfloat16).shape == (0, 3)
