"""A file as it stands at another git revision, written to a temporary file: the kernel
benchmarks build an older kernel source beside this tree's in one process
(``kernel_source``)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def source_at(revision: str, path: str) -> str:
    """The path of a temporary copy of ``path`` (relative to the repository) at ``revision``;
    its name ends as the file's does, so a build keyed by name tells the two apart."""
    text = subprocess.run(
        ["git", "show", f"{revision}:{path}"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout
    suffix = "-" + os.path.basename(path)
    with tempfile.NamedTemporaryFile("w", suffix=suffix, delete=False) as f:
        f.write(text)
    return f.name


@contextlib.contextmanager
def kernel_source(module, source: str | None, cached_loader):
    """Inside, ``module`` (a kernels module with a ``_SOURCE`` C file) builds its library
    from ``source`` (None: its own); ``cached_loader`` is the module's cached build, cleared
    on the way in and out so that neither library is taken for the other."""
    saved = module._SOURCE
    module._SOURCE = source or saved
    cached_loader.cache_clear()
    try:
        yield
    finally:
        module._SOURCE = saved
        cached_loader.cache_clear()
