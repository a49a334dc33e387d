"""Every environment switch minivllm reads, typed and documented in one place.

Read an entry as an attribute, ``minivllm.envs.MINIVLLM_CPU_KVCACHE_SPACE``: the module's
``__getattr__`` reads the environment at that moment (nothing is cached), so a test or a
program that sets a variable at run time is seen, as with vLLM's ``vllm.envs``. The
README's table of switches mirrors ``VARIABLES`` (a test checks it). Where vLLM has a
name for the same switch, that name is read when the ``MINIVLLM_`` one is unset.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for type checkers; at run time __getattr__ answers
    MINIVLLM_CPU_KVCACHE_SPACE: float
    MINIVLLM_CPU_OMP_THREADS_BIND: str
    MINIVLLM_ENABLE_MULTIPROCESSING: bool
    MINIVLLM_ENGINE_IMPORT_NICE: int
    MINIVLLM_CPU_PACKED_LINEAR: bool
    MINIVLLM_CPU_SMALL_BATCH_LINEAR: bool
    MINIVLLM_CPU_ATTN_KERNEL: bool
    MINIVLLM_CPU_LAYER_KERNELS: bool
    MINIVLLM_GPU_LAYER_KERNELS: bool
    MINIVLLM_TRITON_SMALL_M_LINEAR: bool
    MINIVLLM_CPU_GRAPHS: bool
    MINIVLLM_GGUF_KERNEL: str
    MINIVLLM_CPU_HUGE_PAGES: bool
    MINIVLLM_CPU_REUSE_FREED_MEMORY: bool
    MINIVLLM_PREFILL_FIRST: bool
    MINIVLLM_ATTENTION_BACKEND: str | None
    MINIVLLM_CACHE_DIR: str
    MINIVLLM_API_KEY: str | None
    MINIVLLM_TORCH_PROFILER_DIR: str | None
    MINIVLLM_CONFIGURE_LOGGING: bool
    MINIVLLM_LOGGING_LEVEL: str
    MINIVLLM_ALLOW_RUNTIME_LORA_UPDATING: bool
    MINIVLLM_CPU_ISA: str
    MINIVLLM_CPU_OMP_WAIT_POLICY: str
    MINIVLLM_CPU_THREADS_FOLLOW_LOAD: bool
    MINIVLLM_JSON_MAX_DIGITS: int
    MINIVLLM_GRAMMAR_COMPILE_THREADS: int
    MINIVLLM_GRAMMAR_COMPILE_TIMEOUT: float
    MINIVLLM_PP_LAYER_PARTITION: str | None
    MINIVLLM_PP_BATCH_QUEUE: bool
    MINIVLLM_PP_EXTRA_BATCHES: int
    MINIVLLM_DP_LOAD_BALANCING: str
    MINIVLLM_FAIR_SHARE: bool

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class EnvVar:
    """One switch: how its text becomes a value, its default (as text), and what it does."""

    name: str
    parse: Callable[[str, str], Any]  # (name, raw text) -> value; raises ValueError
    default: str | None  # parsed like a set value; None: the value is None
    doc: str
    vllm_alias: str | None = None  # vLLM's name, read when ours is unset

    def raw(self) -> str | None:
        """The text set for this switch (ours first, then vLLM's name), None if unset."""
        value = os.environ.get(self.name)
        if value is None and self.vllm_alias is not None:
            value = os.environ.get(self.vllm_alias)
        if value is None or not value.strip():
            return None
        return value.strip()

    def value(self) -> Any:
        raw = self.raw()
        if raw is None:
            raw = self.default
        return None if raw is None else self.parse(self.name, raw)


def _bool(name: str, raw: str) -> bool:
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    raise ValueError(f"{name} must be 0 or 1, got {raw!r}.")


def _positive_float(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {raw!r}.") from None
    if not value > 0:
        raise ValueError(f"{name} must be positive, got {raw!r}.")
    return value


def _text(name: str, raw: str) -> str:
    return raw


def _gguf_kernel(name: str, raw: str) -> str:
    if raw not in ("int8", "f32"):
        raise ValueError(f"{name} must be int8 or f32, got {raw!r}.")
    return raw


ATTENTION_BACKENDS = {
    "CPU_ATTN": "minivllm.attention.cpu.CPUAttentionBackend",
    "TRITON_ATTN": "minivllm.attention.triton.TritonAttentionBackend",
}


def _attention_backend(name: str, raw: str) -> str:
    if raw not in ATTENTION_BACKENDS:
        raise ValueError(f"{name} must be one of {', '.join(ATTENTION_BACKENDS)}, got {raw!r}.")
    return raw


CPU_ISAS = ("auto", "avx512", "avx2", "generic")


def _cpu_isa(name: str, raw: str) -> str:
    if raw.lower() not in CPU_ISAS:
        raise ValueError(f"{name} must be one of {', '.join(CPU_ISAS)}, got {raw!r}.")
    return raw.lower()


def _non_negative_int(name: str, raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}.") from None
    if value < 0:
        raise ValueError(f"{name} must be at least 0, got {raw!r}.")
    return value


def _positive_int(name: str, raw: str) -> int:
    value = _non_negative_int(name, raw)
    if value == 0:
        raise ValueError(f"{name} must be at least 1, got {raw!r}.")
    return value


def _omp_wait_policy(name: str, raw: str) -> str:
    if raw.lower() not in ("passive", "bounded", "spin"):
        raise ValueError(f"{name} must be passive, bounded or spin, got {raw!r}.")
    return raw.lower()


def _dp_balancing(name: str, raw: str) -> str:
    if raw not in ("prefix", "least_loaded", "round_robin"):
        raise ValueError(f"{name} must be prefix, least_loaded or round_robin, got {raw!r}.")
    return raw


def _log_level(name: str, raw: str) -> str:
    if raw.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise ValueError(f"{name} must be DEBUG, INFO, WARNING, ERROR or CRITICAL, got {raw!r}.")
    return raw.upper()


def _path(name: str, raw: str) -> str:
    return os.path.expanduser(raw)


VARIABLES: tuple[EnvVar, ...] = (
    EnvVar(
        "MINIVLLM_CPU_KVCACHE_SPACE",
        _positive_float,
        "4",
        "KV cache size on the CPU in GiB when `kv_cache_memory_bytes` is not given",
        vllm_alias="VLLM_CPU_KVCACHE_SPACE",
    ),
    EnvVar(
        "MINIVLLM_CPU_OMP_THREADS_BIND",
        _text,
        "auto",
        "CPU threads of each engine process: `auto` gives each tensor-parallel rank an "
        "equal share of the allowed cores; `nobind` keeps torch's own thread count; a core "
        "list such as `0-3` (one per rank, separated by `|`: `0-1|2-3`) pins the rank to "
        "those cores, one thread each",
        vllm_alias="VLLM_CPU_OMP_THREADS_BIND",
    ),
    EnvVar(
        "MINIVLLM_ENABLE_MULTIPROCESSING",
        _bool,
        "1",
        "the engine core runs in its own process, so scheduling and detokenizing overlap "
        "the forward pass (`0`: in the frontend's process)",
    ),
    EnvVar(
        "MINIVLLM_CPU_PACKED_LINEAR",
        _bool,
        "1",
        "linear layers and the LM head run oneDNN's GEMM on weights packed once after loading",
    ),
    EnvVar(
        "MINIVLLM_CPU_SMALL_BATCH_LINEAR",
        _bool,
        "1",
        "batches of 1-128 tokens (decoding one or many sequences) use a C kernel on weights "
        "packed in panels of 16 outputs",
    ),
    EnvVar(
        "MINIVLLM_GGUF_KERNEL",
        _gguf_kernel,
        "int8",
        'with `quantization="gguf"`: `int8` quantizes activations per 32 values and takes '
        "integer dot products; `f32` dequantizes weight tiles to float32 (the exact reference)",
    ),
    EnvVar(
        "MINIVLLM_CPU_ATTN_KERNEL",
        _bool,
        "1",
        "attention reads the paged KV cache in place with a C kernel, a prompt's tokens in "
        "tiles of 8 (OpenMP, on torch's own thread pool)",
    ),
    EnvVar(
        "MINIVLLM_CPU_LAYER_KERNELS",
        _bool,
        "1",
        "on float32 CPU tensors, RMSNorm (with the residual add), SiLU-and-mul, RoPE and "
        "the KV cache write are one C call each instead of several torch ops, and Gated "
        "DeltaNet's gated delta rule (Qwen3-Next, Qwen3.5) is a C scan instead of torch's "
        "chunked form",
    ),
    EnvVar(
        "MINIVLLM_GPU_LAYER_KERNELS",
        _bool,
        "1",
        "on CUDA tensors, RMSNorm (with the residual add), SiLU-and-mul and RoPE are one "
        "Triton kernel each instead of several torch ops",
    ),
    EnvVar(
        "MINIVLLM_TRITON_SMALL_M_LINEAR",
        _bool,
        "0",
        "on CUDA tensors, dense bf16/fp16 products of 1-16 rows (decode steps) use a Triton "
        "kernel that splits the weight over the whole card instead of cuBLAS (opt-in until "
        "measured on a GPU: benchmarks/gpu_session.sh ab MINIVLLM_TRITON_SMALL_M_LINEAR)",
    ),
    EnvVar(
        "MINIVLLM_CPU_GRAPHS",
        _bool,
        "1",
        "decode steps of 1-8 sequences are captured once per batch size as a list of C kernel "
        "calls and replayed without the model's Python (models and steps whose ops are all "
        "such kernels)",
    ),
    EnvVar(
        "MINIVLLM_CPU_REUSE_FREED_MEMORY",
        _bool,
        "1",
        "glibc's malloc keeps freed memory for reuse (no fresh, page-faulting mmap for every "
        "allocation over 32 MiB, such as batch-256 logits)",
    ),
    EnvVar(
        "MINIVLLM_PREFILL_FIRST",
        _bool,
        "1",
        "a step that starts new requests runs prompt tokens only, and the running decodes "
        "go on in the next step: first tokens come sooner, each running request's next "
        "token a step later (`0`: vLLM's mix of decodes and prompt chunks in every step)",
    ),
    EnvVar(
        "MINIVLLM_ATTENTION_BACKEND",
        _attention_backend,
        None,
        "the attention backend, by name: `CPU_ATTN` (C kernels) or `TRITON_ATTN` (Triton; "
        "on a CPU only under `TRITON_INTERPRET=1`, as the tests run it); unset: the device's own",
        vllm_alias="VLLM_ATTENTION_BACKEND",
    ),
    EnvVar(
        "MINIVLLM_CACHE_DIR",
        _path,
        "~/.cache/minivllm",
        "where the compiled C kernels and the tokenizers converted from GGUF files are kept",
    ),
    EnvVar(
        "MINIVLLM_API_KEY",
        _text,
        None,
        "the key `minivllm serve` requires from clients when `--api-key` is not given",
    ),
    EnvVar(
        "MINIVLLM_TORCH_PROFILER_DIR",
        _path,
        None,
        "turns on `start_profile()` / `stop_profile()` (and the servers' `/start_profile`, "
        "`/stop_profile`): each profile writes a torch.profiler trace of the engine core "
        "process to this folder",
        vllm_alias="VLLM_TORCH_PROFILER_DIR",
    ),
    EnvVar(
        "MINIVLLM_CONFIGURE_LOGGING",
        _bool,
        "1",
        "`import minivllm` gives the `minivllm` logger vLLM's log format on stderr (in every "
        "process, the engine core's too); `0` leaves logging to the application",
        vllm_alias="VLLM_CONFIGURE_LOGGING",
    ),
    EnvVar(
        "MINIVLLM_LOGGING_LEVEL",
        _log_level,
        "INFO",
        "the level of the `minivllm` logger when minivllm configures it",
        vllm_alias="VLLM_LOGGING_LEVEL",
    ),
    EnvVar(
        "MINIVLLM_ALLOW_RUNTIME_LORA_UPDATING",
        _bool,
        "0",
        "`minivllm serve --enable-lora` answers `POST /v1/load_lora_adapter` and "
        "`/v1/unload_lora_adapter` (adapters added and removed while it runs)",
        vllm_alias="VLLM_ALLOW_RUNTIME_LORA_UPDATING",
    ),
    EnvVar(
        "MINIVLLM_CPU_ISA",
        _cpu_isa,
        "auto",
        "the instruction set the C kernels are built for: `auto` (this CPU's own, "
        "`-march=native`), or forced to `avx512`, `avx2` (AVX-512 off) or `generic` (plain "
        "C, SSE2), so one machine runs the paths of another (`make test` runs the kernel, "
        "speculative decoding and golden-id tests under each path the CPU has)",
    ),
    EnvVar(
        "MINIVLLM_CPU_OMP_WAIT_POLICY",
        _omp_wait_policy,
        "bounded",
        "how the CPU threads wait between kernels, set at `import minivllm` for the OpenMP "
        "runtime torch loads: `bounded` spins 10,000 times first (`GOMP_SPINCOUNT`; as fast as "
        "spinning on a quiet machine), `passive` sleeps at once (`OMP_WAIT_POLICY=PASSIVE`; "
        "twice one stream's time per token on a quiet machine, the fairest with a fixed "
        "thread count on an overloaded one), `spin` keeps libgomp's own "
        "(spinning that starves when another process wants a core); `OMP_WAIT_POLICY` or "
        "`GOMP_SPINCOUNT` set by the user win",
    ),
    EnvVar(
        "MINIVLLM_CPU_THREADS_FOLLOW_LOAD",
        _bool,
        "1",
        "with `MINIVLLM_CPU_OMP_THREADS_BIND=auto`, the engine's thread count follows the "
        "cores other processes leave free (checked every 2 s: one thread fewer per core "
        "they keep busy); `0` keeps one thread per allowed core",
    ),
    EnvVar(
        "MINIVLLM_JSON_MAX_DIGITS",
        _non_negative_int,
        "16",
        "JSON structured outputs (schemas and `json_object`) allow at most this many digits "
        "in a number's integer part after its first, its fraction and its exponent, as "
        "llama.cpp's JSON grammars do, so a sampled reply cannot write one number until "
        "`max_tokens`; `0`: unbounded",
    ),
    EnvVar(
        "MINIVLLM_GRAMMAR_COMPILE_THREADS",
        _positive_int,
        "4",
        "grammars compiled at once in the engine: a large one (thousands of tools) does not "
        "hold up a small one that arrives after it",
    ),
    EnvVar(
        "MINIVLLM_GRAMMAR_COMPILE_TIMEOUT",
        _positive_float,
        "60",
        "seconds a request waits for its grammar to compile before it fails with that "
        "reason (the others go on meanwhile)",
    ),
    EnvVar(
        "MINIVLLM_PP_LAYER_PARTITION",
        _text,
        None,
        "with `--pipeline-parallel-size N`, the layers of each stage as N comma-separated "
        "counts that add up to the model's layers (`10,14`); unset: as even as whole layers "
        "allow, a remainder on the stages before the last",
        vllm_alias="VLLM_PP_LAYER_PARTITION",
    ),
    EnvVar(
        "MINIVLLM_PP_BATCH_QUEUE",
        _bool,
        "1",
        "with pipeline stages, the engine keeps a batch in flight per stage (the batch "
        "queue); `0`: one batch at a time, each stage idle while the others work (to "
        "measure what the queue gains)",
    ),
    EnvVar(
        "MINIVLLM_PP_EXTRA_BATCHES",
        _non_negative_int,
        "0",
        "with pipeline stages and the batch queue, batches in flight beyond one per stage "
        "(`0`: one per stage, as vLLM's queue); an extra one is work for the first stage while "
        "the engine core turns the oldest batch around, which gained nothing on 2 cores",
    ),
    EnvVar(
        "MINIVLLM_DP_LOAD_BALANCING",
        _dp_balancing,
        "prefix",
        "with `--data-parallel-size N`, how the frontend picks an engine core for a "
        "request: `prefix` the one whose prefix cache holds the longest chain of the "
        "prompt's blocks unless it is overloaded, else the least loaded; `least_loaded`; "
        "`round_robin`",
    ),
    EnvVar(
        "MINIVLLM_ENGINE_IMPORT_NICE",
        _non_negative_int,
        "0",
        "how much lower the CPU priority (the nice increment) of an engine core's start-up "
        "imports (torch, the model code: seconds of CPU), on a thread of their own that then "
        "ends, so the core serves at its normal priority (Linux; no privilege needed); a "
        "many-model server sets `10` unless given, so a model's start slows the loaded "
        "models' requests less",
    ),
    EnvVar(
        "MINIVLLM_CPU_HUGE_PAGES",
        _bool,
        "1",
        "packed GGUF weights (the CPU kernels' layout), the KV cache and the hybrid models' "
        "recurrent states on the host lie in 2 MiB-aligned maps that ask the kernel for "
        "transparent huge pages (Linux, `madvise`): a one-row product "
        "streams its weights past the 4 KiB page ends the hardware prefetch stops at, and "
        "without a TLB walk every 4 KiB (Zen 4: 1.2-1.4x the GB/s of one thread); `0`: "
        "ordinary pages",
    ),
    EnvVar(
        "MINIVLLM_FAIR_SHARE",
        _bool,
        "1",
        "while several requests have work, the n sequences of one request (parallel "
        "sampling) take at most a max-min fair share of a step's tokens and of the free "
        "sequence slots, so a newcomer starts in the next step; a lone request still fills "
        "the step (`0`: vLLM's order alone)",
    ),
)

_BY_NAME = {var.name: var for var in VARIABLES}


def __getattr__(name: str) -> Any:
    var = _BY_NAME.get(name)
    if var is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return var.value()


def __dir__() -> list[str]:
    return sorted(_BY_NAME)


def set_default(name: str, raw: str) -> None:
    """Give a switch a value for this process and the processes it starts, unless the user
    set it (a server's own default: a many-model server's MINIVLLM_ENGINE_IMPORT_NICE)."""
    var = _BY_NAME[name]
    var.parse(name, raw)  # a bad default is the caller's bug: raise here, not in a child
    if var.raw() is None:
        os.environ[name] = raw
