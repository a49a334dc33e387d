"""OPT (``OPTForCausalLM``) written for this engine.

What differs from Llama: learned absolute position embeddings (looked up at position + 2,
OPT's offset), LayerNorm with bias, a plain two-layer MLP (ReLU), biases on every
projection, no RoPE; ``do_layer_norm_before`` False (opt-350m) puts the norms after each
residual sum and drops the final one; ``word_embed_proj_dim`` smaller than the hidden size
projects the embeddings in and the last hidden state out. The query is scaled before
attention, as HF does.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.attention.backend import AttentionBackend
from minivllm.distributed.parallel_state import TPGroup
from minivllm.model.layers.attention import Attention
from minivllm.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minivllm.model.layers.linear import (
    ColumnParallelLinear,
    Linear,
    QKVParallelLinear,
    RowParallelLinear,
)
from minivllm.model.layers.norm import LayerNorm
from minivllm.model.layers.quantization.base import QuantizationConfig
from minivllm.model.weight_loading import load_named_weights

POSITION_OFFSET = 2  # OPT's position table starts with two rows it never looks up
_ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu}


class OPTAttention(nn.Module):
    def __init__(
        self,
        config,
        backend: AttentionBackend,
        tp: TPGroup,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        heads = config.num_attention_heads
        self.head_dim = config.hidden_size // heads
        self.scale = self.head_dim**-0.5
        bias = getattr(config, "enable_bias", True)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            heads,
            heads,
            bias,
            tp,
            quant_config,
            f"{prefix}.qkv_proj",
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.out_proj = RowParallelLinear(
            config.hidden_size, config.hidden_size, bias, tp, quant_config, f"{prefix}.out_proj"
        )
        # No RoPE; the query is scaled here, before attention, as HF does: the layer's is 1.
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, 1.0, backend)

    def forward(self, positions, hidden, meta) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split(
            [self.qkv_proj.q_size, *[self.qkv_proj.kv_size] * 2], -1
        )
        return self.out_proj(self.attn(positions, q * self.scale, k, v, meta))


class OPTDecoderLayer(nn.Module):
    def __init__(
        self,
        config,
        backend,
        tp: TPGroup,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.norm_before = config.do_layer_norm_before
        affine = getattr(config, "layer_norm_elementwise_affine", True)
        bias = getattr(config, "enable_bias", True)
        self.self_attn = OPTAttention(config, backend, tp, quant_config, f"{prefix}.self_attn")
        self.self_attn_layer_norm = LayerNorm(config.hidden_size, affine=affine)
        self.fc1 = ColumnParallelLinear(
            config.hidden_size, config.ffn_dim, bias, tp, quant_config, f"{prefix}.fc1"
        )
        self.fc2 = RowParallelLinear(
            config.ffn_dim, config.hidden_size, bias, tp, quant_config, f"{prefix}.fc2"
        )
        self.final_layer_norm = LayerNorm(config.hidden_size, affine=affine)
        if config.activation_function not in _ACTIVATIONS:
            raise ValueError(f"OPT activation {config.activation_function!r} is not supported")
        self.activation = _ACTIVATIONS[config.activation_function]

    def forward(self, positions, hidden, meta) -> torch.Tensor:
        x = self.self_attn_layer_norm(hidden) if self.norm_before else hidden
        hidden = hidden + self.self_attn(positions, x, meta)
        if not self.norm_before:
            hidden = self.self_attn_layer_norm(hidden)
        x = self.final_layer_norm(hidden) if self.norm_before else hidden
        hidden = hidden + self.fc2(self.activation(self.fc1(x)))
        if not self.norm_before:
            hidden = self.final_layer_norm(hidden)
        return hidden


class OPTDecoder(nn.Module):
    def __init__(
        self,
        config,
        backend,
        tp: TPGroup,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        hidden, embed_dim = config.hidden_size, config.word_embed_proj_dim
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, embed_dim, tp, quant_config)
        # Replicated on every rank: it is small and indexed by position, not by vocabulary.
        self.embed_positions = VocabParallelEmbedding(
            config.max_position_embeddings + POSITION_OFFSET, hidden
        )
        projected = embed_dim != hidden
        self.project_in = (
            Linear(embed_dim, hidden, False, quant_config, f"{prefix}.project_in")
            if projected
            else None
        )
        self.project_out = (
            Linear(hidden, embed_dim, False, quant_config, f"{prefix}.project_out")
            if projected
            else None
        )
        self.layers = nn.ModuleList(
            OPTDecoderLayer(config, backend, tp, quant_config, f"{prefix}.layers.{i}")
            for i in range(config.num_hidden_layers)
        )
        final_norm = config.do_layer_norm_before and not getattr(
            config, "_remove_final_layer_norm", False
        )
        affine = getattr(config, "layer_norm_elementwise_affine", True)
        self.final_layer_norm = LayerNorm(hidden, affine=affine) if final_norm else None

    def forward(self, input_ids, positions, meta) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if self.project_in is not None:
            hidden = self.project_in(hidden)
        hidden = hidden + self.embed_positions(positions + POSITION_OFFSET)
        for layer in self.layers:
            hidden = layer(positions, hidden, meta)
        if self.final_layer_norm is not None:
            hidden = self.final_layer_norm(hidden)
        if self.project_out is not None:
            hidden = self.project_out(hidden)
        return hidden


class OPTModel(nn.Module):
    def __init__(
        self,
        config,
        backend,
        tp: TPGroup,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "model",
    ) -> None:
        super().__init__()
        self.decoder = OPTDecoder(config, backend, tp, quant_config, f"{prefix}.decoder")


class OPTForCausalLM(nn.Module):
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
    }

    def __init__(
        self,
        config,
        backend: AttentionBackend,
        tp: TPGroup | None = None,
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        super().__init__()
        tp = tp if tp is not None else TPGroup()
        self.config = config
        self.model = OPTModel(config, backend, tp, quant_config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        decoder = self.model.decoder
        tied = decoder.embed_tokens if self.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(
            config.vocab_size, config.word_embed_proj_dim, tp, tied, quant_config, "lm_head"
        )

    def forward(self, input_ids, positions, meta) -> torch.Tensor:
        return self.model.decoder(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 logits over the vocabulary; None on tensor-parallel ranks other than 0."""
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.decoder.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_named_weights(
            self,
            weights,
            self.packed_modules_mapping,
            tied_head="lm_head.weight" if self.tie_word_embeddings else None,
            rename=_hf_name,
        )


def _hf_name(name: str) -> str:
    # facebook/opt-* files name the decoder without the "model." prefix HF adds.
    return "model." + name if name.startswith("decoder.") else name
