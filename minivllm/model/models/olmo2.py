"""OLMo 2 (allenai/OLMo-2-*): Llama's attention and MLP, with RMSNorms of q and k over the
whole projection (as OLMoE) and each layer's norms after its sublayers rather than before:

    h = x + post_attention_layernorm(attn(x));   out = h + post_feedforward_layernorm(mlp(h))

The q/k norms span all heads, so one rank must hold all of them: LlamaAttention refuses a
tensor-parallel split.

OLMo 3 is this network with a sliding window on the layers ``layer_types`` says (three of
four in its released configs), each layer type with its RoPE parameters (YaRN, where a
config stretches the context, on the full-attention layers only).
"""

from __future__ import annotations

import torch
from torch import nn

from minivllm.distributed.parallel_state import TPGroup
from minivllm.model.layers.norm import RMSNorm
from minivllm.model.models.llama import MLP, LlamaAttention, LlamaForCausalLM


class Olmo2DecoderLayer(nn.Module):
    def __init__(
        self, config, backend, tp: TPGroup, quant_config, prefix: str, layer_type: str | None = None
    ) -> None:
        """layer_type (OLMo 3): "sliding_attention" or "full_attention"."""
        super().__init__()
        bias = getattr(config, "attention_bias", False)
        window = config.sliding_window if layer_type == "sliding_attention" else None
        self.self_attn = LlamaAttention(
            config,
            backend,
            bias,
            "projection",
            tp,
            quant_config,
            f"{prefix}.self_attn",
            sliding_window=window,
            rope_layer_type=layer_type,
        )
        self.mlp = MLP(config, tp, quant_config, f"{prefix}.mlp")
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, hidden, residual, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """As DecoderLayer's: (this layer's output, the stream before it is added), so that
        the next layer, or the final norm, adds the two."""
        stream = hidden if residual is None else hidden + residual
        stream = stream + self.post_attention_layernorm(self.self_attn(positions, stream, meta))
        return self.post_feedforward_layernorm(self.mlp(stream)), stream


class Olmo2ForCausalLM(LlamaForCausalLM):
    qk_norm = "projection"

    def make_layer(self, config, backend, tp, quant_config, layer: int, prefix: str):
        return Olmo2DecoderLayer(config, backend, tp, quant_config, prefix)


class Olmo3ForCausalLM(Olmo2ForCausalLM):
    def make_layer(self, config, backend, tp, quant_config, layer: int, prefix: str):
        layer_type = config.layer_types[layer]
        return Olmo2DecoderLayer(config, backend, tp, quant_config, prefix, layer_type)
