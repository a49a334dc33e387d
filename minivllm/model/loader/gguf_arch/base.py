"""What every architecture's GGUF piece is made of: ``GGUFArch`` (how llama.cpp wrote the
family: its Hugging Face class, tensor names, layout quirks and config fields), the
metadata reader its config function gets, and llama.cpp's standard tensor names."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from minivllm.model.loader.gguf_header import GGUFHeader

_MISSING = object()


class GGUFMeta:
    """A GGUF file's metadata as a family's config function reads it."""

    def __init__(self, path: str, header: GGUFHeader) -> None:
        self.path = path
        self.header = header
        self.shapes = header.tensor_shapes
        self.arch = header.metadata.get("general.architecture")

    def get(self, key: str, default: Any = _MISSING) -> Any:
        """The architecture's value ``{arch}.{key}``; without a default, required."""
        value = self.header.metadata.get(f"{self.arch}.{key}", default)
        if value is _MISSING:
            raise ValueError(f"GGUF metadata lacks {self.arch}.{key}: {self.path}")
        return value

    def f32_values(self, name: str) -> np.ndarray:
        """A small F32/F16 tensor of the file, as float32 values."""
        type_id, offset = self.header.tensor_data[name]
        dtypes = {0: np.float32, 1: np.float16}  # GGML F32, F16
        if type_id not in dtypes:
            raise ValueError(f"{name} of GGML type {type_id} is not supported: {self.path}")
        count = int(np.prod(self.header.tensor_shapes[name]))
        path = self.header.file_of(name) or self.path  # a split file's part
        values = np.fromfile(path, dtype=dtypes[type_id], count=count, offset=offset)
        return values.astype(np.float32)


# A family's config fields: (metadata, the fields read so far) -> fields to set. It may
# set "model_type" (HF's, when it differs from GGUFArch.model_type: Mixtral, OLMo 3).
ConfigFields = Callable[[GGUFMeta, dict[str, Any]], dict[str, Any]]


def f32_decimal(value: float) -> float:
    """GGUF stores these as float32: the shortest decimal that rounds to the same float32,
    so an epsilon of 1e-5 reads back as 1e-5 and not 9.999999747e-06."""
    return float(str(np.float32(value)))


def layer_types(meta: GGUFMeta, layers: int, every: int) -> list[str]:
    """Each layer's attention, as llama.cpp reads the file: a windowed flag per layer, or a
    pattern n (every n-th layer full, the others windowed; 0: all windowed), by default
    ``every``."""
    pattern = meta.get("attention.sliding_window_pattern", every)
    if isinstance(pattern, np.ndarray):
        windowed = [bool(flag) for flag in pattern.tolist()]
    else:
        n = int(pattern)
        windowed = [n == 0 or i % n < n - 1 for i in range(layers)]
    return ["sliding_attention" if w else "full_attention" for w in windowed]


def kv_heads_per_layer(meta: GGUFMeta) -> list[int]:
    """Each layer's KV head count as the file stores it (0: a layer without attention)."""
    heads = meta.get("attention.head_count_kv")
    layers = int(meta.get("block_count"))
    return [int(n) for n in np.ravel(heads)] if np.ndim(heads) else [int(heads)] * layers


# llama.cpp tensor name (without "blk.N." and suffix) -> Hugging Face module name.
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # Mixtures of experts: the router, and every expert's matrix stacked in one tensor
    # [experts, rows, columns], which the loader yields expert by expert (experts.{e}.*).
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    # Qwen2-MoE's shared expert and its gate (a vector: HF's [1, hidden] Linear).
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}


@dataclass(frozen=True)
class GGUFArch:
    """One ``general.architecture`` of llama.cpp's files, as this engine reads it."""

    name: str  # general.architecture
    hf_architecture: str  # the Hugging Face model class named in config.architectures
    model_type: str | None = None  # HF's model_type; None: the name
    layer_names: Mapping[str, str] = field(default_factory=lambda: LAYER_NAMES)
    config: ConfigFields | None = None  # the family's own config fields
    # llama.cpp's llama converter (and its subclasses') permuted q/k rows for its RoPE.
    permutes_qk: bool = False
    # Norm weights stored with the 1 of Gemma's (1 + w) added (HF's are w).
    norms_plus_one: bool = False
    # attention_bias read from the file (whether blk.0.attn_q.bias is there).
    attention_bias_in_file: bool = False
    # head_count_kv may differ per layer (the family's config reads them).
    per_layer_kv_heads: bool = False
    # rope_freqs holds Llama 3's per-frequency divisors (False: the family reads it).
    rope_freqs_divide: bool = True
    # (HF name, float32 tensor) -> HF's tensor: undoes what llama.cpp's converter did to a
    # small tensor's values or shape (Mamba-2's A stored as -exp(A_log), ...).
    tensor_fix: Callable[[str, Any], Any] | None = None

    @property
    def hf_model_type(self) -> str:
        return self.model_type or self.name
