"""ERNIE 4.5 (dense): HF's layout under llama.cpp's standard names."""

from __future__ import annotations

from minivllm.model.loader.gguf_arch.base import GGUFArch

ARCHITECTURES = [GGUFArch("ernie4_5", "Ernie4_5ForCausalLM")]
