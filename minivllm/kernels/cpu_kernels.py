"""Builds and loads the C kernels (cpu_kernels.c) on first use: paged attention, the
small-batch linear layer and a layer's elementwise work.

The source is compiled with the system C compiler into the cache folder, keyed by its
hash, so later starts only load it (``compile_library``, which gguf_kernels.py uses too).
Without a compiler the engine falls back to torch.
Each user passes its switch (MINIVLLM_CPU_ATTN_KERNEL, MINIVLLM_CPU_SMALL_BATCH_LINEAR);
set to 0 it turns that kernel off, to measure what it gains. MINIVLLM_CPU_ISA forces the
instruction set every library is built for (``isa_flags``), so one machine runs the AVX2 and
plain C paths of another.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import struct
import subprocess
import tempfile

import torch
import torch.nn.functional as F

from minivllm import envs

logger = logging.getLogger(__name__)

_SOURCE = os.path.join(os.path.dirname(__file__), "cpu_kernels.c")
# -ffast-math lets expf use glibc's vector variant (libmvec, linked through -lm). It is
# given to the compile step only: linked with it, GCC 12 adds crtfastmath.o, which turns on
# flush-to-zero for the whole process when the library loads (denormals then read as 0
# in every library of the process, numpy and hypothesis included).
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
_LINK_FLAGS = ["-shared", "-fopenmp"]


def _cache_dir() -> str:
    return os.path.join(envs.MINIVLLM_CACHE_DIR, "kernels")


# What each forced instruction set adds in place of -march=native. The C sources pick their
# intrinsic paths by the macros these define (__AVX512F__, __AVX512VNNI__, __AVX2__, __FMA__):
# -mno-avx512f turns off every AVX-512 extension with it (VNNI, BF16, FP16), and -march=x86-64
# is SSE2 only, the plain C path. Tuning stays native so only the chosen path differs.
_ISA_FLAGS = {
    "avx512": ["-march=native"],
    "avx2": ["-march=native", "-mno-avx512f"],
    "generic": ["-march=x86-64", "-mtune=native"],
}
# The /proc/cpuinfo flag each path needs.
_ISA_NEEDS = {"avx512": b"avx512f", "avx2": b"avx2", "generic": b""}


def isa_paths() -> list[str]:
    """The instruction-set paths this CPU can run, widest first: ``avx512``, ``avx2``,
    ``generic`` (x86; other CPUs have only their native build, called ``generic``)."""
    if not _is_x86():
        return ["generic"]
    return list(_paths_of(_cpu_flags()))


@functools.cache
def _paths_of(flags: bytes) -> tuple[str, ...]:
    # Cached by the flags' line: every decode step's embedding lookup reaches cpu_isa()
    # (gguf_kernels._lib), and splitting the line took ~30 us of a step with cold caches.
    words = flags.split()
    return tuple(isa for isa, need in _ISA_NEEDS.items() if not need or need in words)


def cpu_isa() -> str:
    """The instruction-set path the kernels are built for: MINIVLLM_CPU_ISA, or with
    ``auto`` the widest this CPU runs. A forced path the CPU cannot run is an error (its
    code would die on an illegal instruction)."""
    isa, paths = envs.MINIVLLM_CPU_ISA, isa_paths()
    if isa == "auto":
        return paths[0]
    if isa not in paths:
        raise ValueError(f"MINIVLLM_CPU_ISA={isa}, but this CPU runs only {', '.join(paths)}.")
    return isa


def isa_flags(flags: list[str]) -> list[str]:
    """``flags`` with -march=native replaced by the forced instruction set's flags (as is
    with ``auto``, and on CPUs other than x86, where only ``generic`` is offered)."""
    if envs.MINIVLLM_CPU_ISA == "auto" or not _is_x86():
        return list(flags)
    isa = cpu_isa()
    out: list[str] = []
    for flag in flags:
        out.extend(_ISA_FLAGS[isa] if flag == "-march=native" else [flag])
    return out


@functools.cache
def _is_x86() -> bool:
    import platform

    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


@functools.cache
def _cpu_flags() -> bytes:
    # Cached: every decode step's embedding lookup reaches cpu_isa() (gguf_kernels._lib),
    # and reading /proc/cpuinfo took ~40 us of each step on the 2-vCPU VM.
    try:
        with open("/proc/cpuinfo", "rb") as f:
            return next((line for line in f if line.startswith(b"flags")), b"")
    except OSError:
        return b""


def compile_library(source: str, flags: list[str], what: str) -> ctypes.CDLL | None:
    """``source`` (a C file) compiled with ``flags`` and linked into a shared library in the
    cache folder, then loaded; None (after a warning that names ``what`` falls back) when
    there is no C compiler or the build fails.

    The file is keyed by a hash of the source, the flags and this CPU's flags (-march=native
    code is only good on this CPU), so later starts only load it; the build writes a
    temporary file and renames it, so a concurrent start sees all or nothing. Compiling and
    linking are separate steps: linked with -ffast-math, GCC adds crtfastmath.o, which turns
    on flush-to-zero for the whole process when the library loads. -march=native in
    ``flags`` stands for the instruction set MINIVLLM_CPU_ISA chooses (``isa_flags``), which
    the hash then includes."""
    flags = isa_flags(flags)
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    with open(source, "rb") as f:
        text = f.read()
    digest = hashlib.sha256(text + " ".join(flags).encode() + _cpu_flags()).hexdigest()[:16]
    name = os.path.splitext(os.path.basename(source))[0]
    path = os.path.join(_cache_dir(), f"{name}-{digest}.so")
    if not os.path.exists(path):
        if compiler is None:
            logger.warning("No C compiler found: %s.", what)
            return None
        os.makedirs(_cache_dir(), exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=_cache_dir())
        os.close(fd)
        obj = tmp + ".o"
        try:
            subprocess.run(
                [compiler, *flags, "-fPIC", "-c", source, "-o", obj],
                check=True,
                capture_output=True,
            )
            subprocess.run(
                [compiler, *_LINK_FLAGS, obj, "-o", tmp, "-lm"], check=True, capture_output=True
            )
            os.replace(tmp, path)
        except (OSError, subprocess.CalledProcessError) as err:
            stderr = getattr(err, "stderr", b"") or b""
            logger.warning(
                "Could not build %s (%s %s): %s.", name, err, stderr.decode()[-500:], what
            )
            return None
        finally:
            for leftover in (tmp, obj):
                if os.path.exists(leftover):
                    os.unlink(leftover)
    return ctypes.CDLL(path)


def load_kernels(switch: str) -> ctypes.CDLL | None:
    """The kernel library, or None when the caller's switch (the name of a boolean in
    minivllm.envs) is 0 or the library cannot be built."""
    if not getattr(envs, switch):
        return None
    return load_library()


def load_library(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The library (``extra_flags``: a variant's, e.g. ``-DVL=16`` for the tile shapes of
    another vector width, which the tests build beside this CPU's own); each instruction
    set MINIVLLM_CPU_ISA forces is its own library."""
    return _load_library(extra_flags, cpu_isa())


@functools.cache
def _load_library(extra_flags: tuple[str, ...], isa: str) -> ctypes.CDLL | None:
    lib = compile_library(
        _SOURCE, [*_FLAGS, *extra_flags], "using torch for attention and linear layers"
    )
    if lib is None:
        return None
    ptr, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    signatures = {
        "paged_attention": [ptr, i64] + [ptr] * 6 + [i64] * 6 + [f32, ptr, i64, f32, ptr, i64],
        "panel_linear_f32": [ptr] * 4 + [i64] * 3,
        "rms_norm_f32": [ptr] * 4 + [i64] * 2 + [f32],
        "silu_and_mul_f32": [ptr] * 2 + [i64] * 2,
        "rotary_embedding_f32": [ptr, ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64, i64, i64],
        "write_kv_f32": [ptr, i64, ptr, i64, ptr, ptr, ptr] + [i64] * 4,
        "write_kv_quantized": [ptr, i64, ptr, i64, ptr, ptr, ptr] + [i64] * 5,
        "lora_add_f32": [ptr] * 4 + [i64] * 5 + [ptr],
    }
    returns_status = ("paged_attention", "write_kv_quantized")  # 0: arguments refused
    for name, argtypes in signatures.items():
        function = getattr(lib, name)
        function.restype = ctypes.c_int if name in returns_status else None
        function.argtypes = argtypes
    attach_slot_twins(lib, list(signatures))
    lib.run_calls.restype = None
    lib.run_calls.argtypes = [i64, ptr, ptr, ptr]
    return lib


def attach_slot_twins(lib: ctypes.CDLL, names: list[str]) -> None:
    """Give each kernel the address of its twin that takes its arguments as 64-bit slots
    (``NAME_slots``, see run_calls in cpu_kernels.c): a CPU graph makes the calls in C."""
    for name in names:
        twin = getattr(lib, f"{name}_slots")
        getattr(lib, name).slots = ctypes.cast(twin, ctypes.c_void_p).value


def as_slots(function, args) -> list[int]:
    """A kernel call's arguments as its slot twin reads them: pointers and integers as they
    are (None: 0), floats as a double's bits."""
    slots = []
    for value, argtype in zip(args, function.argtypes, strict=True):
        if argtype is ctypes.c_float:
            slots.append(struct.unpack("<q", struct.pack("<d", value))[0])
        else:
            slots.append(0 if value is None else int(value))
    return slots


# The calls of a step being captured for replay (worker/cpu_graph.py), or None.
_recording: list | None = None


def launch(function, *args, dynamic: dict[int, str] | None = None, checked: bool = False) -> None:
    """Call a kernel; while a step is being captured, also note the call. ``dynamic`` names
    the arguments that change from step to step (index -> name of a step input) and are
    filled in again at each replay. ``checked``: the kernel returns 0 when it refuses its
    arguments (a type or shape it does not take), which raises here rather than leave the
    output unwritten (a replay makes the same call, which was taken once)."""
    if _recording is not None:
        _recording.append((function, args, dynamic))
    if function(*args) == 0 and checked:
        raise RuntimeError(f"the kernel {function.__name__} refused its arguments {args}")


def is_cpu_f32(*tensors: torch.Tensor) -> bool:
    """Whether the layer kernels below can take these tensors (float32, in host memory:
    the platform of their device says)."""
    for t in tensors:  # a plain loop: this runs several times per layer
        if t.dtype != torch.float32 or not _runs_c_kernels(t.device.type, t.dtype):
            return False
    return True


@functools.cache
def _runs_c_kernels(device_type: str, dtype: torch.dtype) -> bool:
    from minivllm.platforms import get_platform

    return get_platform(device_type).runs_c_kernels(dtype)


# Outputs per panel of a packed weight: one 16-float vector of panel_linear_f32.
PANEL_WIDTH = 16


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] in panels of PANEL_WIDTH outputs, [ceil(N / 16), K, 16]: the last
    panel's missing outputs are rows of zeros."""
    weight = F.pad(weight.detach(), (0, 0, 0, -weight.shape[0] % PANEL_WIDTH))
    n, k = weight.shape
    return weight.view(n // PANEL_WIDTH, PANEL_WIDTH, k).transpose(1, 2).contiguous()


def panel_rows(panels: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of the weight that ``pack_panels`` packed, [len(ids), K]."""
    return panels[ids // PANEL_WIDTH, :, ids % PANEL_WIDTH]


def panel_linear(
    lib: ctypes.CDLL, x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias), W [n, K] packed by ``pack_panels`` (see cpu_kernels.c)."""
    x = x.contiguous()
    m, k = x.shape
    if not (panels.shape[0] - 1) * PANEL_WIDTH < n <= panels.shape[0] * PANEL_WIDTH:
        raise ValueError(f"{panels.shape[0]} panels do not hold {n} outputs")
    y = x.new_empty(m, n)
    bias_ptr = bias.data_ptr() if bias is not None else None
    launch(lib.panel_linear_f32, x.data_ptr(), panels.data_ptr(), bias_ptr, y.data_ptr(), m, n, k)
    return y


# Query rows per tile of the attention kernel (its TILE): a prompt's rows go in tiles of
# this many rows of one request.
ATTENTION_TILE_ROWS = 8


def paged_attention(
    lib: ctypes.CDLL,
    q: torch.Tensor,  # [B, H, D] float32; rows may be strided (a view of the fused qkv)
    k_cache: torch.Tensor,  # [num_blocks, Hkv, D, block_size] (bytes when quantized: only
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]  its address is read)
    block_table: torch.Tensor,  # [B, max_blocks] int64
    seq_lens: torch.Tensor,  # [B] int64: row b attends positions [0, seq_lens[b])
    scale: float,
    window: int | None = None,  # the layer's sliding window, with:
    starts: torch.Tensor | None = None,  # [B] int64: each row's first attended position
    tiles: torch.Tensor | None = None,  # [num_tiles + 1] int64 row bounds; None: a row each
    soft_cap: float | None = None,  # scores become c * tanh(s / c) before the softmax
    sinks: torch.Tensor | None = None,  # [H] float32: each head's attention sink (gpt-oss)
    kv_type: int = 0,  # what the cache holds: KVCacheFormat.code (0: float32)
) -> torch.Tensor:
    """Each row is one query token over its request's cache; a tile's rows are one
    request's, at consecutive positions, and share the kernel's loads."""
    batch, num_heads, head_dim = q.shape
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()
    _, block_size, num_kv_heads, _ = v_cache.shape
    out = q.new_empty(batch, num_heads, head_dim)
    args = (
        q.data_ptr(),
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_table.data_ptr(),
        seq_lens.data_ptr(),
        starts.data_ptr() if starts is not None else None,
        out.data_ptr(),
    )
    dims = (num_heads, num_kv_heads, head_dim, block_size, block_table.shape[1], scale)
    tiling = (None, batch) if tiles is None else (tiles.data_ptr(), tiles.numel() - 1)
    # The block table, sequence lengths and window starts are new tensors each step (and
    # the table's width changes): a replayed step takes its own.
    dynamic = {4: "block_table", 5: "seq_lens", 13: "max_blocks"}
    if starts is not None:
        dynamic[6] = f"window_starts:{window}"
    if tiles is not None:
        dynamic[15] = "attention_tiles"  # nor is a step with a prompt in it
    sinks_ptr = sinks.data_ptr() if sinks is not None else None
    launch(
        lib.paged_attention,
        *args,
        batch,
        *dims,
        *tiling,
        soft_cap or 0.0,
        sinks_ptr,
        kv_type,
        dynamic=dynamic,
        checked=True,
    )
    return out


def rms_norm(
    lib: ctypes.CDLL,
    x: torch.Tensor,  # [..., n] contiguous
    weight: torch.Tensor,  # [n]
    eps: float,
    residual: torch.Tensor | None = None,  # like x, contiguous; updated in place
) -> torch.Tensor:
    """weight * normalized(x), or with residual: residual += x, then the norm of that."""
    n = x.shape[-1]
    out = torch.empty_like(x)
    res_ptr = residual.data_ptr() if residual is not None else None
    launch(
        lib.rms_norm_f32,
        x.data_ptr(),
        res_ptr,
        weight.data_ptr(),
        out.data_ptr(),
        x.numel() // n,
        n,
        eps,
    )
    return out


def lora_add(
    lib: ctypes.CDLL,
    x: torch.Tensor,  # [m, k] contiguous
    a: torch.Tensor,  # [slices * rank, k] contiguous
    b: torch.Tensor,  # [n, slices * rank] contiguous
    out: torch.Tensor,  # [m, n] contiguous; updated in place
    rank: int,
    slice_ends: torch.Tensor,  # [slices] int64: each projection's last output row + 1
) -> None:
    """out += (x A^T) B^T, B block-diagonal by projection (see cpu_kernels.c)."""
    m, k = x.shape
    launch(
        lib.lora_add_f32,
        x.data_ptr(),
        a.data_ptr(),
        b.data_ptr(),
        out.data_ptr(),
        m,
        k,
        out.shape[1],
        slice_ends.numel(),
        rank,
        slice_ends.data_ptr(),
    )


def silu_and_mul(lib: ctypes.CDLL, x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [gate | up] ([..., 2d], contiguous): [..., d]."""
    d = x.shape[-1] // 2
    out = x.new_empty(*x.shape[:-1], d)
    launch(lib.silu_and_mul_f32, x.data_ptr(), out.data_ptr(), x.numel() // (2 * d), d)
    return out


def rotary_embedding(
    lib: ctypes.CDLL,
    positions: torch.Tensor,  # [T] int64
    q: torch.Tensor,  # [T, H, D], heads contiguous, rows may be strided; rotated in place
    k: torch.Tensor,  # [T, Hkv, D], the same
    cos: torch.Tensor,  # [num_positions, R]: the first R of each head's D turn (R <= D)
    sin: torch.Tensor,
) -> None:
    num_tokens, num_heads, head_dim = q.shape
    launch(
        lib.rotary_embedding_f32,
        positions.data_ptr(),
        q.data_ptr(),
        q.stride(0),
        num_heads,
        k.data_ptr(),
        k.stride(0),
        k.shape[1],
        cos.data_ptr(),
        sin.data_ptr(),
        cos.shape[1],
        num_tokens,
        head_dim,
    )


def write_kv(
    lib: ctypes.CDLL,
    k: torch.Tensor,  # [T, Hkv, D], heads contiguous, rows may be strided
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, Hkv, D, block_size] (bytes when quantized)
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slots: torch.Tensor,  # [T] int64
    kv_type: int = 0,  # KVCacheFormat.code: 0 float32, else quantized as it is written
) -> None:
    num_tokens, num_kv_heads, head_dim = k.shape
    if kv_type:
        launch(
            lib.write_kv_quantized,
            k.data_ptr(),
            k.stride(0),
            v.data_ptr(),
            v.stride(0),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            slots.data_ptr(),
            num_tokens,
            num_kv_heads,
            head_dim,
            v_cache.shape[1],
            kv_type,
            checked=True,
        )
        return
    launch(
        lib.write_kv_f32,
        k.data_ptr(),
        k.stride(0),
        v.data_ptr(),
        v.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slots.data_ptr(),
        num_tokens,
        num_kv_heads,
        head_dim,
        v_cache.shape[1],
    )
