"""Models in LM Studio's folder, served in place: ``lmstudio:publisher/repo`` (the repo's
only GGUF file), ``lmstudio:publisher/repo:Q4_K_M`` (that quantization) or
``lmstudio:publisher/repo/file.gguf``.

The folder is the ``downloadsFolder`` of ``~/.lmstudio/settings.json`` when it names one,
else ``~/.lmstudio/models``, else the older ``~/.cache/lm-studio/models``; inside, models
sit as ``<publisher>/<repo>/<file>.gguf``, as LM Studio downloads them.
"""

from __future__ import annotations

import json
import os

from minivllm.model.sources.errors import ModelSourceError
from minivllm.model.sources.hub import quant_of


def lmstudio_models_dir() -> str:
    home = os.path.expanduser("~")
    try:
        with open(os.path.join(home, ".lmstudio", "settings.json"), encoding="utf-8") as f:
            folder = json.load(f).get("downloadsFolder")
        if isinstance(folder, str) and os.path.isdir(os.path.expanduser(folder)):
            return os.path.expanduser(folder)
    except (OSError, ValueError, AttributeError):
        pass
    for folder in (
        os.path.join(home, ".lmstudio", "models"),
        os.path.join(home, ".cache", "lm-studio", "models"),
    ):
        if os.path.isdir(folder):
            return folder
    return os.path.join(home, ".lmstudio", "models")


def resolve_lmstudio(name: str) -> str:
    store = lmstudio_models_dir()
    repo, _, quant = name.partition(":")
    if ".." in repo.split("/") or repo.startswith("/"):
        raise ModelSourceError(f"{'lmstudio:' + name!r} is not an LM Studio model name.")
    path = os.path.join(store, repo)
    if repo.endswith(".gguf") and os.path.isfile(path):
        return path
    if not os.path.isdir(path):
        raise ModelSourceError(
            f"LM Studio has no model {repo!r} in {store}: download it in LM Studio, or name "
            f"it as publisher/repo as it appears in that folder."
        )
    ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf") and "mmproj" not in f)
    if quant:
        ggufs = [f for f in ggufs if quant_of(f).lower() == quant.lower()]
    if len(ggufs) != 1:
        found = ", ".join(sorted(os.listdir(path))) or "nothing"
        raise ModelSourceError(
            f"LM Studio's {repo!r} ({path}) holds {len(ggufs)} GGUF files matching "
            f"{quant or 'any quantization'}; name one as lmstudio:{repo}:QUANT (found: {found})."
        )
    return os.path.join(path, ggufs[0])
