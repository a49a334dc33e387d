"""Per-architecture GGUF support: how llama.cpp wrote each family, one module a family."""

# Each module holds its family's GGUFArch (base.py): the Hugging Face class and model_type,
# the tensor name map, layout quirks and a config function ((GGUFMeta, fields so far) ->
# fields). ../gguf.py reads every file the same way and asks ARCHITECTURES for what differs.
# A new architecture is one GGUFArch in a module here, its module listed in _FAMILIES.

from __future__ import annotations

from minivllm.model.loader.gguf_arch import (
    ernie,
    gemma,
    gemma4,
    glm4,
    gpt_oss,
    granite_hybrid,
    lfm2,
    llama,
    olmo,
    phi3,
    qwen,
    qwen35,
)
from minivllm.model.loader.gguf_arch.base import LAYER_NAMES, GGUFArch, GGUFMeta

_FAMILIES = (
    llama,
    qwen,
    gemma,
    gemma4,
    phi3,
    olmo,
    gpt_oss,
    glm4,
    ernie,
    lfm2,
    granite_hybrid,
    qwen35,
)

# general.architecture -> its GGUFArch.
ARCHITECTURES: dict[str, GGUFArch] = {
    arch.name: arch for family in _FAMILIES for arch in family.ARCHITECTURES
}

__all__ = ["ARCHITECTURES", "LAYER_NAMES", "GGUFArch", "GGUFMeta"]
