"""Where a model's files come from: a local path, the Hugging Face Hub, Ollama, LM Studio."""

# | the name                              | where the files are                              |
# | ------------------------------------- | ------------------------------------------------ |
# | a path (a folder or a .gguf file)     | there                                            |
# | ``org/name``                          | the Hugging Face Hub, through its local cache    |
# | ``org/name-GGUF:Q4_K_M`` (or hf_file) | that quantization's GGUF file(s) of a Hub repo   |
# | ``ollama:qwen3:4b``                   | Ollama's store (``$OLLAMA_MODELS``), in place    |
# | ``lmstudio:publisher/repo[:Q4_K_M]``  | LM Studio's models folder, in place              |
#
# Every failure is a ``ModelSourceError``: one line that names the model and what to do.

from __future__ import annotations

import os

from minivllm.model.sources.errors import ModelSourceError

__all__ = ["ModelSourceError", "resolve_model_source", "source_defaults"]

OLLAMA_PREFIX = "ollama:"
LMSTUDIO_PREFIX = "lmstudio:"


def resolve_model_source(
    model: str | os.PathLike | None,
    *,
    revision: str | None = None,
    download_dir: str | None = None,
    hf_file: str | None = None,
) -> str | None:
    """A local path for ``model`` (None stays None), downloading from the Hub if need be."""
    if model is None:
        return None
    model = os.fspath(model)
    if os.path.exists(os.path.expanduser(model)):
        return model
    if model.startswith(OLLAMA_PREFIX):
        from minivllm.model.sources.ollama import resolve_ollama

        return resolve_ollama(model[len(OLLAMA_PREFIX) :])
    if model.startswith(LMSTUDIO_PREFIX):
        from minivllm.model.sources.lmstudio import resolve_lmstudio

        return resolve_lmstudio(model[len(LMSTUDIO_PREFIX) :])
    from minivllm.model.sources.hub import is_hub_name, resolve_hub

    if not is_hub_name(model):
        return model  # a bad local path: the loader says it does not exist
    return resolve_hub(model, revision=revision, download_dir=download_dir, hf_file=hf_file)


def source_defaults(model: str | os.PathLike | None) -> tuple[dict, int | None]:
    """What a model's store says about serving it, as ``generation_config.json`` does for
    an HF checkpoint: (default SamplingParams fields, a context length or None). Only an
    Ollama manifest's parameters say anything today (temperature, top_p, top_k, stop,
    num_ctx, ...)."""
    if isinstance(model, str) and model.startswith(OLLAMA_PREFIX):
        from minivllm.model.sources.ollama import ollama_defaults

        return ollama_defaults(model[len(OLLAMA_PREFIX) :])
    return {}, None
