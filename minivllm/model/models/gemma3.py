"""Gemma 3 (the text model, ``Gemma3ForCausalLM``) and Gemma 2 written for this engine.

What differs from Llama: RMS norms scale by (1 + weight); four norms per layer (before and
after attention, before and after the MLP); per-head q/k norms; a GeGLU MLP (tanh GELU);
embeddings multiplied by sqrt(hidden_size), rounded to the model dtype as HF does; the
attention scale comes from ``query_pre_attn_scalar``; most layers attend over a sliding
window and rotate with their own RoPE base (``rope_local_base_freq``), the others attend
globally; the final logits are soft-capped where the config says so.

Gemma 2 is the same network without the q/k norms, with every other layer sliding, one RoPE
base, and attention scores soft-capped (``attn_logit_softcapping``), which HF's Gemma 3
leaves out.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from minivllm.attention.backend import AttentionBackend
from minivllm.distributed.parallel_state import TPGroup
from minivllm.model.layers.activation import GeluAndMul
from minivllm.model.layers.attention import Attention
from minivllm.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minivllm.model.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from minivllm.model.layers.norm import GemmaRMSNorm
from minivllm.model.layers.quantization.base import QuantizationConfig
from minivllm.model.layers.rotary import get_rope, rope_parameters
from minivllm.model.weight_loading import load_named_weights

SLIDING, FULL = "sliding_attention", "full_attention"


def layer_types(config, gemma2: bool = False) -> list[str]:
    """Each layer's attention kind; old configs name only the pattern (Gemma 3: every 6th
    global, Gemma 2: every 2nd)."""
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    pattern = getattr(config, "sliding_window_pattern", None) or (2 if gemma2 else 6)
    return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(config.num_hidden_layers)]


class Gemma3Attention(nn.Module):
    def __init__(
        self,
        config,
        layer_type: str,
        backend: AttentionBackend,
        tp: TPGroup,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        gemma2: bool = False,
    ) -> None:
        super().__init__()
        total_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.scale = config.query_pre_attn_scalar**-0.5
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            total_heads,
            config.num_key_value_heads,
            getattr(config, "attention_bias", False),
            tp,
            quant_config,
            f"{prefix}.qkv_proj",
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(
            total_heads * self.head_dim,
            config.hidden_size,
            bias=getattr(config, "attention_bias", False),
            tp=tp,
            quant_config=quant_config,
            prefix=f"{prefix}.o_proj",
        )
        self.q_norm = None if gemma2 else GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = None if gemma2 else GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        rotary = get_rope(
            self.head_dim,
            config.max_position_embeddings,
            rope_parameters(config, layer_type),
            torch.float32,
        )
        self.attn = Attention(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.scale,
            backend,
            rotary,
            sliding_window=config.sliding_window if layer_type == SLIDING else None,
            # Gemma 3 configs carry attn_logit_softcapping, but HF's Gemma 3 attention never
            # applies it (only Gemma 2's does), nor does vLLM's: neither does this.
            logits_soft_cap=getattr(config, "attn_logit_softcapping", None) if gemma2 else None,
        )

    def forward(self, positions, hidden, meta) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        if self.q_norm is not None:
            q = self.q_norm(q.view(-1, self.num_heads, self.head_dim))
            k = self.k_norm(k.view(-1, self.num_kv_heads, self.head_dim))
        return self.o_proj(self.attn(positions, q, k, v, meta))


class Gemma3MLP(nn.Module):
    def __init__(
        self,
        config,
        tp: TPGroup,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        size: int | None = None,
    ) -> None:
        """size: the MLP's width, if not intermediate_size (Gemma 4's double-wide ones)."""
        super().__init__()
        if config.hidden_activation != "gelu_pytorch_tanh":
            raise ValueError(f"Gemma activation {config.hidden_activation!r} is not supported")
        size = size or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size,
            {0: size, 1: size},
            False,
            tp,
            quant_config,
            f"{prefix}.gate_up_proj",
        )
        self.down_proj = RowParallelLinear(
            size, config.hidden_size, False, tp, quant_config, f"{prefix}.down_proj"
        )
        # Into a buffer of its own (out=): a CPU graph replays it, and the down projection
        # gets contiguous rows.
        self.act_fn = GeluAndMul("tanh")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Gemma3DecoderLayer(nn.Module):
    def __init__(
        self,
        config,
        layer_type: str,
        backend,
        tp: TPGroup,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        gemma2: bool = False,
    ) -> None:
        super().__init__()
        self.self_attn = Gemma3Attention(
            config, layer_type, backend, tp, quant_config, f"{prefix}.self_attn", gemma2
        )
        self.mlp = Gemma3MLP(config, tp, quant_config, f"{prefix}.mlp")
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(self, positions, hidden, meta) -> torch.Tensor:
        """hidden: the residual stream, which this layer adds to in place (the model's:
        its scaled embeddings, or the inputs_embeds it was given)."""
        attn = self.self_attn(positions, self.input_layernorm(hidden), meta)
        hidden += self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        hidden += self.post_feedforward_layernorm(mlp)
        return hidden


class Gemma3Model(nn.Module):
    def __init__(
        self,
        config,
        backend,
        tp: TPGroup,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "model",
        gemma2: bool = False,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, tp, quant_config
        )
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(
                config, kind, backend, tp, quant_config, f"{prefix}.layers.{i}", gemma2
            )
            for i, kind in enumerate(layer_types(config, gemma2))
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        # HF multiplies by sqrt(hidden) cast to the weights' dtype (2.0 bits of bf16 matter).
        self.register_buffer("normalizer", torch.tensor(config.hidden_size**0.5), persistent=False)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        embed = self.embed_tokens(input_ids)
        return embed * self.normalizer.to(embed.dtype)

    def forward(self, input_ids, positions, meta, inputs_embeds=None) -> torch.Tensor:
        # The layers add to the residual stream in place: a fresh tensor, or the
        # caller's inputs_embeds (a CPU graph's static input, rewritten every replay).
        hidden = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        for layer in self.layers:
            hidden = layer(positions, hidden, meta)
        return self.norm(hidden)


class Gemma3ForCausalLM(nn.Module):
    gemma2 = False
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
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
        self.model = self.make_model(config, backend, tp, quant_config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        tied = self.model.embed_tokens if self.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(
            config.vocab_size, config.hidden_size, tp, tied, quant_config, "lm_head"
        )
        self.final_soft_cap = getattr(config, "final_logit_softcapping", None)

    def make_model(self, config, backend, tp: TPGroup, quant_config) -> nn.Module:
        return Gemma3Model(config, backend, tp, quant_config, gemma2=self.gemma2)

    def forward(self, input_ids, positions, meta, inputs_embeds=None) -> torch.Tensor:
        """inputs_embeds (vLLM's argument): the embedded tokens (scaled), instead of
        input_ids; the layers add to them in place."""
        return self.model(input_ids, positions, meta, inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 logits over the vocabulary; None on tensor-parallel ranks other than 0."""
        logits = self.lm_head(hidden)
        if logits is not None and self.final_soft_cap:
            # In the model's dtype, as HF and vLLM do: bfloat16 logits (exact in float32)
            # are capped in bfloat16.
            cap = self.final_soft_cap
            logits = (torch.tanh(logits.to(hidden.dtype) / cap) * cap).float()
        return logits

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_named_weights(
            self,
            weights,
            self.packed_modules_mapping,
            tied_head="lm_head.weight" if self.tie_word_embeddings else None,
        )


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    gemma2 = True


class TextOfMultimodal:
    """A checkpoint with image (and audio) towers served as its language model: the towers
    and projectors are not loaded, and the text weights drop their prefix."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(
            (text, tensor) for name, tensor in weights if (text := _text_weight(name))
        )


class Gemma3ForConditionalGeneration(TextOfMultimodal, Gemma3ForCausalLM):
    """Gemma 3 4B/12B/27B checkpoints (text and images)."""


def _text_weight(name: str) -> str | None:
    """The language model's name of a multimodal checkpoint's weight, or None (vision)."""
    for prefix in ("language_model.", "model.language_model."):
        if name.startswith(prefix):
            rest = name[len(prefix) :]
            # transformers 5 keeps "model.language_model.layers..." (no inner "model.").
            return rest if rest.startswith(("model.", "lm_head.")) else f"model.{rest}"
    return name if name.startswith("lm_head.") else None
