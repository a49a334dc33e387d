"""GLM-4 (THUDM/GLM-4-9B-0414, GLM-Z1): Llama's attention (q/k/v biases) and MLP with a norm
on each side of both sublayers:

    h = x + post_self_attn_layernorm(attn(input_layernorm(x)))
    out = h + post_mlp_layernorm(mlp(post_attention_layernorm(h)))

RoPE turns the first half of each head (partial_rotary_factor 0.5) in interleaved pairs
(dimensions 2i and 2i + 1, GPT-J's layout): loading reorders those rows of q_proj and k_proj
into halves (the evens, then the odds), the layout this engine's RoPE turns, so that q.k
is unchanged. Checkpoints fuse gate and up (``mlp.gate_up_proj``), as Phi-3's.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from minivllm.distributed.parallel_state import TPGroup
from minivllm.model.layers.norm import RMSNorm
from minivllm.model.layers.quantization.base import QuantizationConfig
from minivllm.model.layers.quantization.gguf import GGUFTensor
from minivllm.model.layers.rotary import rope_parameters
from minivllm.model.models.llama import MLP, LlamaAttention, LlamaForCausalLM
from minivllm.model.models.phi3 import unfused


class Glm4DecoderLayer(nn.Module):
    def __init__(
        self, config, backend, tp: TPGroup, quant_config: QuantizationConfig | None, prefix: str
    ) -> None:
        super().__init__()
        bias = getattr(config, "attention_bias", True)
        self.self_attn = LlamaAttention(
            config, backend, bias, None, tp, quant_config, f"{prefix}.self_attn"
        )
        self.mlp = MLP(config, tp, quant_config, f"{prefix}.mlp")
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_self_attn_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_mlp_layernorm = RMSNorm(config.hidden_size, eps)

    def forward(self, positions, hidden, residual, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """As DecoderLayer's: (this layer's output, the stream before it is added)."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_self_attn_layernorm(self.self_attn(positions, hidden, meta))
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.post_mlp_layernorm(self.mlp(hidden)), residual


class Glm4ForCausalLM(LlamaForCausalLM):
    supports_pipeline_parallel = False  # its weight reading asks layer 0

    def make_layer(self, config, backend, tp, quant_config, layer: int, prefix: str):
        return Glm4DecoderLayer(config, backend, tp, quant_config, prefix)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        config = self.config
        head_dim = self.model.layers[0].self_attn.head_dim
        rotary = int(head_dim * rope_parameters(config).get("partial_rotary_factor", 1.0))
        return super().load_weights(
            halves_from_pairs(unfused(weights, config, head_dim), head_dim, rotary)
        )


def halves_from_pairs(
    weights: Iterable[tuple[str, torch.Tensor]], head_dim: int, rotary_dim: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """q_proj's and k_proj's rows (weights and biases) with each head's first rotary_dim
    reordered from interleaved pairs to halves: [0, 2, 4, ..., 1, 3, 5, ...], the rest kept
    (GLM-4, ERNIE 4.5)."""
    order = torch.arange(head_dim)
    order[:rotary_dim] = torch.cat([order[0:rotary_dim:2], order[1:rotary_dim:2]])
    for name, tensor in weights:
        if ".q_proj." in name or ".k_proj." in name:
            heads = tensor.shape[0] // head_dim
            index = (order + head_dim * torch.arange(heads).unsqueeze(1)).flatten()
            if isinstance(tensor, GGUFTensor):  # its rows are whole blocks
                tensor = GGUFTensor(tensor.raw.index_select(0, index), tensor.qtype, tensor.shape)
            else:
                tensor = tensor.index_select(0, index)
        yield name, tensor
