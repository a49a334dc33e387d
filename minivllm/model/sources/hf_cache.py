"""The local Hugging Face cache, read without the network (``HF_HUB_OFFLINE=1``).

The cache is the one ``huggingface_hub`` fills (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``,
else ``~/.cache/huggingface/hub``), in its layout ``models--org--name/snapshots/<rev>/``.
"""

from __future__ import annotations

import os


def hf_hub_cache_dir() -> str:
    """The folder huggingface_hub caches models in, from the same variables it reads."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    hf_home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface"
    )
    return os.path.join(os.path.expanduser(hf_home), "hub")


def cached_snapshot(repo: str, revision: str | None, cache: str) -> str | None:
    """The cached snapshot folder of ``repo`` at ``revision`` (a branch, tag or commit;
    None: the one refs/main names, else the newest); None when the cache has none."""
    repo_dir = os.path.join(cache, "models--" + repo.replace("/", "--"))
    snapshots = os.path.join(repo_dir, "snapshots")
    ref = os.path.join(repo_dir, "refs", revision or "main")
    if os.path.isfile(ref):
        with open(ref, encoding="utf-8") as f:
            candidate = os.path.join(snapshots, f.read().strip())
        if os.path.isdir(candidate):
            return candidate
    if revision is not None:
        candidate = os.path.join(snapshots, revision)
        return candidate if os.path.isdir(candidate) else None
    if not os.path.isdir(snapshots):
        return None
    revisions = [os.path.join(snapshots, r) for r in os.listdir(snapshots)]
    revisions = [r for r in revisions if os.path.isdir(r)]
    return max(revisions, key=os.path.getmtime) if revisions else None


def snapshot_files(snapshot: str) -> list[str]:
    """The files of a snapshot, as paths inside the repo ('Q4_K_M/x.gguf')."""
    return sorted(
        os.path.relpath(os.path.join(root, name), snapshot)
        for root, _, names in os.walk(snapshot)
        for name in names
    )


def is_complete_checkpoint(snapshot: str, files: list[str]) -> bool:
    """A config and every safetensors shard its index names (or one safetensors file)."""
    if "config.json" not in files:
        return False
    index = os.path.join(snapshot, "model.safetensors.index.json")
    if os.path.isfile(index):
        import json

        with open(index, encoding="utf-8") as f:
            shards = set(json.load(f).get("weight_map", {}).values())
        return all(os.path.isfile(os.path.join(snapshot, s)) for s in shards)
    return any(f.endswith(".safetensors") for f in files) or "pytorch_model.bin" in files
