"""Models in Ollama's store, served in place: ``ollama:qwen3:4b`` reads the manifest that
``ollama pull`` wrote and serves its GGUF blob without copying it.

The store is ``$OLLAMA_MODELS`` (Ollama's own variable), else ``~/.ollama/models``: a
manifest per model under ``manifests/<host>/<namespace>/<model>/<tag>`` (JSON, the layers
by media type and digest) and the blobs under ``blobs/sha256-<hex>``. Names follow
Ollama's: ``model[:tag]`` is ``registry.ollama.ai/library/model:tag``, ``user/model:tag``
another namespace; the tag defaults to ``latest``.
"""

from __future__ import annotations

import json
import os
import re

from minivllm import envs
from minivllm.model.sources.errors import ModelSourceError

MODEL_LAYER = "application/vnd.ollama.image.model"
ADAPTER_LAYER = "application/vnd.ollama.image.adapter"
PARAMS_LAYER = "application/vnd.ollama.image.params"
_PART = re.compile(r"^[\w][\w.-]*$")


def ollama_models_dir() -> str:
    return os.path.expanduser(os.environ.get("OLLAMA_MODELS") or "~/.ollama/models")


def parse_name(name: str) -> tuple[str, str, str, str]:
    """``qwen3:4b`` -> (registry.ollama.ai, library, qwen3, 4b)."""
    path, _, tag = name.partition(":")
    parts = path.split("/")
    if len(parts) > 3 or not all(_PART.match(p) for p in parts + [tag or "latest"]):
        raise ModelSourceError(f"{'ollama:' + name!r} is not an Ollama model name (model:tag).")
    host, namespace = "registry.ollama.ai", "library"
    if len(parts) == 3:
        host, namespace = parts[0], parts[1]
    elif len(parts) == 2:
        namespace = parts[0]
    return host, namespace, parts[-1], tag or "latest"


def read_manifest(name: str) -> tuple[dict, str]:
    """The manifest of ``name`` and the store it was found in."""
    store = ollama_models_dir()
    host, namespace, model, tag = parse_name(name)
    path = os.path.join(store, "manifests", host, namespace, model, tag)
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f), store
    except FileNotFoundError:
        raise ModelSourceError(
            f"Ollama has no model {name!r} in {store} (no {path}): run `ollama pull {name}`, "
            f"or set OLLAMA_MODELS to the folder that holds Ollama's models."
        ) from None
    except (OSError, ValueError) as e:
        raise ModelSourceError(f"Ollama's manifest {path} cannot be read: {e}") from None


def blob_path(store: str, digest: str) -> str:
    if not re.match(r"^sha256[:-][0-9a-f]{64}$", digest):
        raise ModelSourceError(f"an Ollama manifest names a malformed digest {digest!r}.")
    return os.path.join(store, "blobs", "sha256-" + digest[7:])


def resolve_ollama(name: str) -> str:
    """A path ending in .gguf that is the model's blob itself (a symbolic link to it, kept
    in minivllm's cache folder: the loaders know a GGUF file by its name)."""
    manifest, store = read_manifest(name)
    layers = manifest.get("layers") or []
    if any(layer.get("mediaType") == ADAPTER_LAYER for layer in layers):
        raise ModelSourceError(
            f"Ollama model {name!r} applies an adapter layer, which minivllm does not read."
        )
    models = [layer for layer in layers if layer.get("mediaType") == MODEL_LAYER]
    if not models:
        raise ModelSourceError(f"Ollama's manifest of {name!r} names no model layer.")
    blob = blob_path(store, str(models[0].get("digest", "")))
    if not os.path.isfile(blob):
        raise ModelSourceError(
            f"Ollama's blob {blob} of {name!r} is missing: run `ollama pull {name}` again."
        )
    return _gguf_link(blob, "ollama", "_".join(parse_name(name)))


def _gguf_link(target: str, store: str, name: str) -> str:
    """A symbolic link named ``<name>.gguf`` in the cache folder, pointing at ``target``."""
    folder = os.path.join(envs.MINIVLLM_CACHE_DIR, store)
    os.makedirs(folder, exist_ok=True)
    link = os.path.join(folder, re.sub(r"[^\w.-]", "_", name) + ".gguf")
    if os.path.islink(link) and os.readlink(link) == target:
        return link
    tmp = f"{link}.{os.getpid()}.tmp"
    os.symlink(target, tmp)
    os.replace(tmp, link)
    return link


def ollama_parameters(name: str) -> dict:
    """The sampling parameters the manifest sets (Ollama's names), {} when none."""
    manifest, store = read_manifest(name)
    for layer in manifest.get("layers") or []:
        if layer.get("mediaType") == PARAMS_LAYER:
            try:
                with open(blob_path(store, str(layer.get("digest", ""))), encoding="utf-8") as f:
                    params = json.load(f)
            except (OSError, ValueError):
                return {}
            return params if isinstance(params, dict) else {}
    return {}


# Ollama's parameter names (a Modelfile's PARAMETER lines) -> SamplingParams' fields.
_SAMPLING_NAMES = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repeat_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "stop": "stop",
    "seed": "seed",
    "num_predict": "max_tokens",
}


def ollama_defaults(name: str) -> tuple[dict, int | None]:
    """What the manifest's parameters mean for serving the model: (default SamplingParams
    fields, the context length ``num_ctx`` or None). Parameters of Ollama's runner that
    have no counterpart here (num_gpu, num_thread, mirostat, repeat_last_n, ...) are left
    out; so is num_predict below 1 (-1: no limit, -2: fill the context)."""
    sampling: dict = {}
    params = ollama_parameters(name)
    for key, field in _SAMPLING_NAMES.items():
        value = params.get(key)
        if value is None or (key == "num_predict" and int(value) < 1):
            continue
        if key == "stop":
            value = [value] if isinstance(value, str) else [str(s) for s in value]
        elif key in ("top_k", "seed", "num_predict"):
            value = int(value)
        else:
            value = float(value)
        sampling[field] = value
    num_ctx = params.get("num_ctx")
    return sampling, int(num_ctx) if num_ctx and int(num_ctx) > 0 else None
