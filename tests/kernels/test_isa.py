"""MINIVLLM_CPU_ISA: a library built for a forced instruction set sees that set's macros
(which the C sources choose their intrinsic paths by), each set in its own cached file; the
GGUF kernels built for the current set take its path; a set this CPU cannot run is refused
by name."""

from __future__ import annotations

import ctypes

import pytest

from minivllm.kernels import cpu_kernels
from minivllm.kernels import gguf_kernels as gk

# What each set's build must define, as gguf_kernels.c and cpu_kernels.c test them.
PROBE = r"""
const char *widest(void) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  return "avx512";
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  return "avx2";
#elif defined(__AVX__) || defined(__AVX512F__) || defined(__FMA__)
  return "partial";
#else
  return "generic";
#endif
}
"""
PACKED_PATHS = {"avx512": "avx512-vnni", "avx2": "avx2", "generic": "portable"}


def probe(tmp_path) -> ctypes.CDLL:
    source = tmp_path / "probe.c"
    source.write_text(PROBE)
    lib = cpu_kernels.compile_library(str(source), ["-O1", "-march=native"], "no probe")
    assert lib is not None
    lib.widest.restype = ctypes.c_char_p
    return lib


@pytest.mark.parametrize("isa", ["avx512", "avx2", "generic"])
def test_a_forced_isa_builds_with_its_macros_into_its_own_file(isa, tmp_path, monkeypatch):
    if isa not in cpu_kernels.isa_paths():
        pytest.skip(f"this CPU has no {isa}")
    monkeypatch.setenv("MINIVLLM_CPU_ISA", isa)
    assert cpu_kernels.cpu_isa() == isa
    lib = probe(tmp_path)
    assert lib.widest().decode() == isa
    monkeypatch.setenv("MINIVLLM_CPU_ISA", "auto")
    native = probe(tmp_path)
    # The same source and flags for another set: another file (the cache key has the set).
    assert (native._name == lib._name) == (isa == cpu_kernels.isa_paths()[0])


def test_the_gguf_kernels_take_the_forced_path():
    expected = PACKED_PATHS[cpu_kernels.cpu_isa()]
    if expected == "avx512-vnni" and b"avx512_vnni" not in cpu_kernels._cpu_flags().split():
        expected = "avx2"  # AVX-512 without VNNI takes the AVX2 integer path
    assert gk.packed_path(gk.load_gguf_kernels()) == expected


def test_auto_is_the_widest_and_unknown_sets_are_refused(monkeypatch):
    monkeypatch.setenv("MINIVLLM_CPU_ISA", "auto")
    assert cpu_kernels.cpu_isa() == cpu_kernels.isa_paths()[0]
    assert cpu_kernels.isa_flags(["-march=native"]) == ["-march=native"]
    monkeypatch.setattr(cpu_kernels, "_is_x86", lambda: True)
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: b"flags : sse2 avx avx2 fma")
    assert cpu_kernels.isa_paths() == ["avx2", "generic"]
    monkeypatch.setenv("MINIVLLM_CPU_ISA", "avx512")
    with pytest.raises(ValueError, match="runs only avx2, generic"):
        cpu_kernels.cpu_isa()
    monkeypatch.setenv("MINIVLLM_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="MINIVLLM_CPU_ISA must be one of"):
        cpu_kernels.cpu_isa()
