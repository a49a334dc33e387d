"""The models a many-model server may serve, by name: every GGUF file and Hugging Face
directory below --models-dir, and each --model NAME=SOURCE (a path, a Hub id, ollama: or
lmstudio: name; resolved when the model first loads, by create_config)."""

from __future__ import annotations

import os
import re

# The first part of a split GGUF (name-00001-of-00003.gguf) names the model; the others
# are read with it.
_SPLIT_PART = re.compile(r"-(\d{5})-of-\d{5}$")


def _gguf_name(file_name: str) -> str | None:
    """The served name of a GGUF file, or None for one that is not a model of its own (a
    later part of a split file, a vision projector)."""
    stem = file_name[: -len(".gguf")]
    split = _SPLIT_PART.search(stem)
    if split is not None:
        if split.group(1) != "00001":
            return None
        stem = stem[: split.start()]
    if stem.startswith("mmproj") or "-mmproj" in stem:
        return None
    return stem


def scan_models_dir(models_dir: str) -> dict[str, str]:
    """{name: path} for every model below ``models_dir``: a GGUF file under its file stem,
    a folder with a config.json under the folder's name (not looked into further). Two
    models with one name are a ValueError naming both paths."""
    root = os.path.expanduser(models_dir)
    if not os.path.isdir(root):
        raise ValueError(f"--models-dir {models_dir!r} is not a directory.")
    found: dict[str, str] = {}

    def add(name: str, path: str) -> None:
        if name in found:
            raise ValueError(
                f"--models-dir: two models are named {name!r}: {found[name]} and {path}; "
                "rename one, or serve it with --model NAME=PATH."
            )
        found[name] = path

    for folder, subfolders, files in os.walk(root, followlinks=True):
        subfolders.sort()
        if folder != root and "config.json" in files:
            add(os.path.basename(folder), folder)
            subfolders.clear()  # a checkpoint's own folders hold no other models
            continue
        for file_name in sorted(files):
            if file_name.endswith(".gguf"):
                name = _gguf_name(file_name)
                if name is not None:
                    add(name, os.path.join(folder, file_name))
    return found


def parse_model_spec(text: str) -> tuple[str, str] | None:
    """``NAME=SOURCE`` as (name, source); None for a plain model (a path or Hub id with no
    ``=`` before its first ``/``), which the one-model form serves as it always has."""
    name, sep, source = text.partition("=")
    if not sep or not name or "/" in name or os.path.exists(os.path.expanduser(text)):
        return None
    if not source:
        raise ValueError(f"--model {text!r}: NAME=SOURCE needs a source after '='.")
    return name, source


def model_catalog(models_dir: str | None, specs: list[tuple[str, str]]) -> dict[str, str]:
    """{name: source} of the server: the folder's models, then the named ones (a name given
    twice, or named in the folder too, is a ValueError)."""
    catalog = scan_models_dir(models_dir) if models_dir else {}
    for name, source in specs:
        if name in catalog:
            raise ValueError(f"--model {name}={source}: the name {name!r} is already served "
                             f"({catalog[name]}).")  # fmt: skip
        catalog[name] = source
    if not catalog:
        raise ValueError(f"--models-dir {models_dir!r} holds no GGUF file or model folder.")
    return catalog


def estimated_weight_bytes(source: str) -> int:
    """The bytes of a model's weight files on disk (GGUF, safetensors, .bin), the estimate of
    its weights' memory before it has loaded once; 0 where the source is no local path."""
    path = os.path.expanduser(source)
    if os.path.isfile(path):
        folder = os.path.dirname(path)
        stem = _SPLIT_PART.sub("", os.path.basename(path)[: -len(".gguf")])
        parts = [
            os.path.join(folder, f)
            for f in os.listdir(folder)
            if f.endswith(".gguf") and _SPLIT_PART.sub("", f[: -len(".gguf")]) == stem
        ]
        return sum(os.path.getsize(p) for p in parts) or os.path.getsize(path)
    if os.path.isdir(path):
        return sum(
            os.path.getsize(os.path.join(path, f))
            for f in os.listdir(path)
            if f.endswith((".safetensors", ".bin", ".gguf"))
        )
    return 0
