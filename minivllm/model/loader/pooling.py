"""How a checkpoint says its embeddings are pooled: sentence-transformers' files in a Hugging
Face directory, or a GGUF header's ``{arch}.pooling_type`` (llama.cpp's key)."""

from __future__ import annotations

import json
import os

from minivllm.model.loader.gguf import is_gguf, read_gguf_header

# llama.cpp's enum llama_pooling_type: 0 none, 1 mean, 2 cls, 3 last, 4 rank.
_GGUF_POOLING_TYPES = {1: "MEAN", 2: "CLS", 3: "LAST"}
# sentence-transformers' Pooling module modes, in the order it prefers them.
_ST_POOLING_MODES = {
    "pooling_mode_lasttoken": "LAST",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
}


def checkpoint_pooling(path: str) -> tuple[str | None, bool | None]:
    """(pooling type, normalize) as the checkpoint declares them; None where it says nothing.

    A GGUF embedding model names its pooling type (and llama.cpp normalizes its embeddings);
    a sentence-transformers directory lists a Pooling module (its mode) and, when its
    embeddings are normalized, a Normalize module (vLLM reads the same files)."""
    if is_gguf(path):
        meta = read_gguf_header(path).metadata
        arch = meta.get("general.architecture")
        value = meta.get(f"{arch}.pooling_type")
        if value is None:
            return None, None
        kind = int(value)
        if kind not in _GGUF_POOLING_TYPES:
            raise ValueError(
                f"GGUF pooling type {kind} is not supported (mean, cls and last are): {path}"
            )
        return _GGUF_POOLING_TYPES[kind], True
    modules_file = os.path.join(path, "modules.json")
    if not os.path.isfile(modules_file):
        return None, None
    with open(modules_file) as f:
        modules = json.load(f)
    pooling_type, normalize = None, False
    for module in modules:
        kind = module.get("type", "")
        if kind.endswith("Normalize"):
            normalize = True
        elif kind.endswith("Pooling"):
            pooling_type = _st_pooling_type(
                os.path.join(path, module.get("path", ""), "config.json")
            )
    return pooling_type, normalize


def _st_pooling_type(config_file: str) -> str | None:
    if not os.path.isfile(config_file):
        return None
    with open(config_file) as f:
        config = json.load(f)
    for mode, pooling_type in _ST_POOLING_MODES.items():
        if config.get(mode):
            return pooling_type
    return None


def has_pooling_type(path: str) -> bool:
    """Whether a GGUF file declares itself an embedding model (runner "auto" pools it)."""
    return is_gguf(path) and checkpoint_pooling(path)[0] is not None
