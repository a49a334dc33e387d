"""Hugging Face model names (`facebook/opt-125m`) resolved in the local Hugging Face cache.

minivllm never touches the network: a name that is not a local path is looked up in the
cache that `huggingface_hub` fills (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
`~/.cache/huggingface/hub`), in its layout `models--org--name/snapshots/<revision>/`. When
the files are not there, the error says where it looked and how to provide them.
"""

from __future__ import annotations

import os
import re

# A hub repository id: "name" or "org/name" (letters, digits, -, _, .).
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def hf_hub_cache_dir() -> str:
    """The folder huggingface_hub caches models in, from the same variables it reads."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    hf_home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface"
    )
    return os.path.join(os.path.expanduser(hf_home), "hub")


def is_repo_id(name: str) -> bool:
    return bool(_REPO_ID.match(name)) and not name.endswith(".gguf") and ".." not in name


def _snapshot(repo_dir: str) -> str | None:
    """The revision refs/main names, else the newest snapshot; None when there is none."""
    snapshots = os.path.join(repo_dir, "snapshots")
    ref = os.path.join(repo_dir, "refs", "main")
    if os.path.isfile(ref):
        with open(ref, encoding="utf-8") as f:
            candidate = os.path.join(snapshots, f.read().strip())
        if os.path.isdir(candidate):
            return candidate
    if not os.path.isdir(snapshots):
        return None
    revisions = [os.path.join(snapshots, r) for r in os.listdir(snapshots)]
    revisions = [r for r in revisions if os.path.isdir(r)]
    return max(revisions, key=os.path.getmtime) if revisions else None


def _model_in(snapshot: str) -> str | None:
    """The snapshot itself when it holds an HF checkpoint, else its only .gguf file."""
    if os.path.isfile(os.path.join(snapshot, "config.json")):
        return snapshot
    ggufs = sorted(f for f in os.listdir(snapshot) if f.endswith(".gguf"))
    return os.path.join(snapshot, ggufs[0]) if len(ggufs) == 1 else None


def resolve_model_name(model: str | None) -> str | None:
    """`model` itself when it is None or an existing path; a cached snapshot for a hub name.

    Raises FileNotFoundError, naming the folder it looked in and how to provide the files,
    when `model` is a hub name that is not in the local cache.
    """
    if model is None:
        return None
    model = os.fspath(model)
    if os.path.exists(os.path.expanduser(model)) or not is_repo_id(model):
        return model  # a local path (or a bad one, which the loader reports)
    cache = hf_hub_cache_dir()
    repo_dir = os.path.join(cache, "models--" + model.replace("/", "--"))
    snapshot = _snapshot(repo_dir)
    found = _model_in(snapshot) if snapshot is not None else None
    if found is not None:
        return found
    where = snapshot or os.path.join(repo_dir, "snapshots", "<revision>")
    raise FileNotFoundError(
        f"Model {model!r} is not a local path, and the local Hugging Face cache has no "
        f"checkpoint for it (looked in {where}; the cache is $HF_HUB_CACHE, else "
        f"$HF_HOME/hub: {cache}). minivllm never downloads anything. Provide the files: "
        f"on a machine with network access run `huggingface-cli download {model}` and copy "
        f"that cache here (or point HF_HOME / HF_HUB_CACHE at it), or pass a local model "
        f"directory (config.json + *.safetensors + tokenizer files) or a .gguf file."
    )
