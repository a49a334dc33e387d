"""A file as it stands at another git revision, written to a temporary file: the kernel
benchmarks build an older kernel source beside this tree's in one process."""

from __future__ import annotations

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
