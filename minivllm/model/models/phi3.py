"""Phi-3 (``Phi3ForCausalLM``: Phi-3, Phi-3.5 and Phi-4 mini) written for this engine.

The network is Llama's (llama.py) with a sliding window where the config sets one; what
differs is the checkpoint, which holds q/k/v as one ``qkv_proj`` ([q | k | v] rows) and
gate/up as one ``gate_up_proj`` ([gate | up] rows). Loading cuts each fused tensor into the
shards a Llama checkpoint has, so the fused layers' weight loaders shard them by heads or
rows for tensor parallelism as they do Llama's. A GGUF file's ``attn_qkv`` and ``ffn_up``
come through the GGUF loader under these names, dequantized or as GGUF blocks (whole rows,
so they cut the same way).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from minivllm.attention.backend import AttentionBackend
from minivllm.distributed.parallel_state import TPGroup
from minivllm.model.layers.quantization.base import QuantizationConfig
from minivllm.model.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    uses_sliding_window = True
    supports_pipeline_parallel = False  # its weight reading asks layer 0

    def __init__(
        self,
        config,
        backend: AttentionBackend,
        tp: TPGroup | None = None,
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"Phi-3 activation {act!r} is not supported")
        super().__init__(config, backend, tp, quant_config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        head_dim = self.model.layers[0].self_attn.head_dim
        return super().load_weights(unfused(weights, self.config, head_dim))


def unfused(
    weights: Iterable[tuple[str, torch.Tensor]], config, head_dim: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with qkv_proj and gate_up_proj cut into Llama's shards (row
    views: the shards' loaders copy what their rank holds); GLM-4 fuses gate_up_proj too."""
    q_rows = config.num_attention_heads * head_dim
    kv_rows = config.num_key_value_heads * head_dim
    qkv = {"q_proj": (0, q_rows), "k_proj": (q_rows, kv_rows)}
    qkv["v_proj"] = (q_rows + kv_rows, kv_rows)
    size = config.intermediate_size
    gate_up = {"gate_proj": (0, size), "up_proj": (size, size)}
    for name, tensor in weights:
        if ".qkv_proj." in name:
            fused, parts = "qkv_proj", qkv
        elif ".gate_up_proj." in name:
            fused, parts = "gate_up_proj", gate_up
        else:
            yield name, tensor
            continue
        rows = sum(length for _, length in parts.values())
        if tensor.shape[0] != rows:
            raise ValueError(f"{name}: expected {rows} rows, got {tensor.shape[0]}")
        for part, (start, length) in parts.items():
            yield name.replace(f".{fused}.", f".{part}."), tensor.narrow(0, start, length)
