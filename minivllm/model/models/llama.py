"""The Llama family (Llama, Mistral, Qwen2, Qwen3) written for this engine.

One flat batch of tokens without padding; attention goes through the paged KV cache.
The variants differ only in switches read from the HF config: q/k/v bias (Qwen2),
per-head q/k RMSNorm (Qwen3), a sliding window (Mistral), explicit head_dim, tied
embeddings. Phi-3 (phi3.py) is this network with fused checkpoint tensors.

Tensor parallelism (Megatron style): q/k/v and gate/up are column-parallel, o_proj and
down_proj row-parallel (one all-reduce each per layer), the embedding and the LM head
vocabulary-parallel; each rank attends over its own heads and caches its own KV heads.

Pipeline parallelism: a stage (``PPGroup``) builds only its consecutive layers (the others
are ``PPMissingLayer``, with no weights); the first stage embeds, the last normalizes and
holds the LM head; a stage's forward takes and returns the residual stream between the
layers (``IntermediateTensors``).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch
from torch import nn

from minivllm.attention.backend import AttentionBackend
from minivllm.distributed.parallel_state import PPGroup, TPGroup
from minivllm.model.layers.activation import SiluAndMul
from minivllm.model.layers.attention import Attention
from minivllm.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minivllm.model.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from minivllm.model.layers.norm import RMSNorm
from minivllm.model.layers.quantization.base import QuantizationConfig
from minivllm.model.layers.rotary import get_rope, rope_parameters
from minivllm.model.layers.state_cache import StateLayer
from minivllm.model.weight_loading import load_named_weights


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config,
        backend: AttentionBackend,
        qkv_bias: bool,
        qk_norm: str | None,
        tp: TPGroup,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        sliding_window: int | None = None,
        use_rope: bool = True,
        rope_layer_type: str | None = None,
    ) -> None:
        """use_rope: False for SmolLM3's layers without positions (NoPE); rope_layer_type:
        the layer's type where the config nests its RoPE parameters by type (OLMo 3)."""
        super().__init__()
        total_heads = config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // total_heads
        # Granite sets the scores' scale (attention_multiplier) in place of 1/sqrt(head_dim).
        self.scale = getattr(config, "attention_multiplier", None) or self.head_dim**-0.5
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            total_heads,
            config.num_key_value_heads,
            qkv_bias,
            tp,
            quant_config,
            f"{prefix}.qkv_proj",
        )
        # This rank's heads.
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(
            total_heads * self.head_dim,
            config.hidden_size,
            bias=False,
            tp=tp,
            quant_config=quant_config,
            prefix=f"{prefix}.o_proj",
        )
        # q/k RMSNorms (after the projection, before RoPE): over each head ("head": Qwen3)
        # or over the whole projection ("projection": OLMoE, one rank holding every head).
        self.qk_norm = qk_norm
        q_width, k_width = self.head_dim, self.head_dim
        if qk_norm == "projection" and tp.size > 1:  # OLMoE, OLMo 2
            raise ValueError(
                f"{getattr(config, 'model_type', 'this model')}'s q/k norms span every "
                "attention head, which tensor parallelism splits across ranks: use "
                "tensor_parallel_size=1"
            )
        if qk_norm == "projection":
            q_width, k_width = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.q_norm = RMSNorm(q_width, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(k_width, config.rms_norm_eps) if qk_norm else None
        # OLMoE's clip_qkv: q, k (normalised) and v clamped to [-clip, clip] (None in its
        # released configs).
        self.clip_qkv = getattr(config, "clip_qkv", None)
        rotary = None
        if use_rope:
            params = rope_parameters(config, rope_layer_type)
            rotary = get_rope(self.head_dim, config.max_position_embeddings, params, torch.float32)
        self.attn = Attention(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.scale,
            backend,
            rotary,
            sliding_window=sliding_window,
        )

    def forward(self, positions, hidden, meta) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        if self.qk_norm == "head":
            q = self.q_norm(q.view(-1, self.num_heads, self.head_dim))
            k = self.k_norm(k.view(-1, self.num_kv_heads, self.head_dim))
        elif self.qk_norm == "projection":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:  # after the norms, as HF's OLMoE
            for t in (q, k, v):
                t.clamp_(-self.clip_qkv, self.clip_qkv)
        return self.o_proj(self.attn(positions, q, k, v, meta))


class MLP(nn.Module):
    def __init__(
        self, config, tp: TPGroup, quant_config: QuantizationConfig | None = None, prefix: str = ""
    ) -> None:
        super().__init__()
        size = config.intermediate_size
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, {0: size, 1: size}, bias, tp, quant_config, f"{prefix}.gate_up_proj"
        )
        self.down_proj = RowParallelLinear(
            size, config.hidden_size, bias, tp, quant_config, f"{prefix}.down_proj"
        )
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config,
        backend,
        qkv_bias: bool,
        qk_norm: str | None,
        tp: TPGroup,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        sliding_window: int | None = None,
        mlp: nn.Module | None = None,
        use_rope: bool = True,
        self_attn: nn.Module | None = None,
    ) -> None:
        """mlp: the layer's MLP, in place of the dense one (a mixture of experts); self_attn:
        its attention, in place of LlamaAttention (gpt-oss's, with sinks)."""
        super().__init__()
        self.self_attn = self_attn or LlamaAttention(
            config,
            backend,
            qkv_bias,
            qk_norm,
            tp,
            quant_config,
            f"{prefix}.self_attn",
            sliding_window,
            use_rope,
        )
        self.mlp = mlp if mlp is not None else MLP(config, tp, quant_config, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Granite scales each sublayer's output before it joins the residual stream.
        self.residual_multiplier = float(getattr(config, "residual_multiplier", 1.0))

    def forward(self, positions, hidden, residual, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's output, the residual stream before it is added): each norm adds the
        previous sublayer's output to the stream as it normalizes (vLLM's layout)."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self._scaled(self.self_attn(positions, hidden, meta))
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self._scaled(self.mlp(hidden)), residual

    def _scaled(self, out: torch.Tensor) -> torch.Tensor:
        # In place (out is the sublayer's own new tensor): a CPU graph replays in-place ops.
        return out if self.residual_multiplier == 1.0 else out.mul_(self.residual_multiplier)


class PPMissingLayer(nn.Module):
    """A layer another pipeline stage holds: no weights here, never called."""


class IntermediateTensors(NamedTuple):
    """The residual stream between two pipeline stages: the last layer's output and the
    stream before it is added (``DecoderLayer.forward``'s pair)."""

    hidden: torch.Tensor
    residual: torch.Tensor


class DecoderModel(nn.Module):
    def __init__(
        self,
        config,
        backend,
        qkv_bias: bool,
        qk_norm: str | None,
        tp: TPGroup,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "model",
        sliding_window: int | None = None,
        make_mlp: Callable[[int, str], nn.Module | None] | None = None,
        make_layer: Callable[[int, str], nn.Module | None] | None = None,
        pp: PPGroup | None = None,
        keep_embedding: bool = False,
    ) -> None:
        """make_mlp(layer index, prefix): that layer's MLP where it is not the dense one,
        else None; make_layer(layer index, prefix): the whole layer where it is not a
        DecoderLayer (OLMo 2's norms after the sublayers), else None. pp: the pipeline
        stage whose layers to build (None: all); keep_embedding: a later stage keeps the
        embedding too (the LM head shares it)."""
        super().__init__()
        self.pp = pp = pp if pp is not None else PPGroup()
        self.embed_tokens = None
        if pp.is_first or keep_embedding:
            self.embed_tokens = VocabParallelEmbedding(
                config.vocab_size, config.hidden_size, tp, quant_config
            )
        make_mlp = make_mlp or (lambda i, prefix: None)
        make_layer = make_layer or (lambda i, prefix: None)
        self.start_layer, self.end_layer = pp.layer_range(config.num_hidden_layers)
        self.layers = nn.ModuleList(
            PPMissingLayer()
            if not self.start_layer <= i < self.end_layer
            else make_layer(i, f"{prefix}.layers.{i}")
            or DecoderLayer(
                config,
                backend,
                qkv_bias,
                qk_norm,
                tp,
                quant_config,
                f"{prefix}.layers.{i}",
                sliding_window,
                mlp=make_mlp(i, f"{prefix}.layers.{i}.mlp"),
                use_rope=layer_uses_rope(config, i),
            )
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if pp.is_last else None
        self.embedding_multiplier = float(getattr(config, "embedding_multiplier", 1.0))  # Granite

    @property
    def stage_layers(self) -> list[nn.Module]:
        """The layers this stage holds, in order."""
        return list(self.layers)[self.start_layer : self.end_layer]

    def forward(
        self, input_ids, positions, meta, inputs_embeds=None, intermediate=None
    ) -> torch.Tensor | IntermediateTensors:
        """intermediate: the previous stage's output, on a later pipeline stage; a stage
        before the last returns its own."""
        if intermediate is not None:
            hidden, residual = intermediate
        else:
            hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
            if self.embedding_multiplier != 1.0:
                hidden = hidden.mul_(self.embedding_multiplier)  # in place, as _scaled
            residual = None
        for layer in itertools.islice(self.layers, self.start_layer, self.end_layer):
            hidden, residual = layer(positions, hidden, residual, meta)
        if self.norm is None:
            return IntermediateTensors(hidden, residual)
        return self.norm(hidden, residual)[0]


def layer_uses_rope(config, index: int) -> bool:
    """Whether layer ``index`` rotates q and k: SmolLM3's no_rope_layers holds 0 for the
    layers that do not (every fourth, in its released configs), as HF's model reads it."""
    flags = getattr(config, "no_rope_layers", None)
    return not flags or bool(flags[index])


class LlamaForCausalLM(nn.Module):
    # checkpoint name -> (fused parameter name, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    qk_norm: str | None = None  # q/k RMSNorms: "head" (Qwen3), "projection" (OLMoE)
    # Whether the config's sliding_window applies (Mistral, Phi-3): Qwen2 configs carry one
    # that use_sliding_window turns off, and HF's Qwen2 ignores it then.
    uses_sliding_window = False
    # Whether the class builds one pipeline stage when given ``pp`` (a subclass whose own
    # __init__ or weight reading needs every layer, or that keeps per-request state, not).
    supports_pipeline_parallel = True

    def __init__(
        self,
        config,
        backend: AttentionBackend,
        tp: TPGroup | None = None,
        quant_config: QuantizationConfig | None = None,
        pp: PPGroup | None = None,
    ) -> None:
        """tp: this rank's tensor-parallel group; None runs the whole model here.
        quant_config: the weight format, which picks each linear layer's method.
        pp: this worker's pipeline stage, whose layers alone it builds (None: every one)."""
        super().__init__()
        tp = tp if tp is not None else TPGroup()
        pp = pp if pp is not None else PPGroup()
        self.config = config
        qkv_bias = getattr(config, "attention_bias", False) or self.default_qkv_bias
        window = getattr(config, "sliding_window", None) if self.uses_sliding_window else None
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.model = DecoderModel(
            config,
            backend,
            qkv_bias,
            self.qk_norm,
            tp,
            quant_config,
            sliding_window=window,
            make_mlp=lambda i, prefix: self.make_mlp(config, i, tp, quant_config, prefix),
            make_layer=lambda i, prefix: self.make_layer(
                config, backend, tp, quant_config, i, prefix
            ),
            pp=pp,
            keep_embedding=self.tie_word_embeddings and pp.is_last,
        )
        tied = self.model.embed_tokens if self.tie_word_embeddings else None
        self.lm_head = None
        if pp.is_last:
            self.lm_head = ParallelLMHead(
                config.vocab_size, config.hidden_size, tp, tied, quant_config, "lm_head"
            )
        self.logits_scaling = float(getattr(config, "logits_scaling", 1.0))  # Granite divides

    default_qkv_bias = False

    def make_mlp(
        self, config, layer: int, tp: TPGroup, quant_config: QuantizationConfig | None, prefix
    ) -> nn.Module | None:
        """Layer ``layer``'s MLP where it is not the dense one (a mixture of experts)."""
        return None

    def make_layer(
        self, config, backend, tp: TPGroup, quant_config: QuantizationConfig | None, layer: int,
        prefix: str,
    ) -> nn.Module | None:  # fmt: skip
        """Layer ``layer`` where it is not a DecoderLayer."""
        return None

    def forward(
        self, input_ids, positions, meta, inputs_embeds=None, intermediate=None
    ) -> torch.Tensor | IntermediateTensors:
        """inputs_embeds (vLLM's argument): the embedded tokens, instead of input_ids. The
        residual stream is updated in them in place. intermediate: the previous pipeline
        stage's output (a stage before the last returns its own)."""
        if intermediate is not None:
            return self.model(input_ids, positions, meta, inputs_embeds, intermediate)
        return self.model(input_ids, positions, meta, inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 logits over the vocabulary; None on tensor-parallel ranks other than 0."""
        logits = self.lm_head(hidden)
        if logits is not None and self.logits_scaling != 1.0:
            logits = logits / self.logits_scaling
        return logits

    def attention_layers(self) -> list[Attention]:
        """This stage's attention layers (every one without pipeline parallelism)."""
        return [
            layer.self_attn.attn
            for layer in self.model.stage_layers
            if not isinstance(layer.self_attn, StateLayer)
        ]

    def state_layers(self) -> list[StateLayer]:
        """The mixers that keep a per-request state instead of a KV cache (a hybrid
        family's make_layer puts them where attention sits); none for plain decoders."""
        return [
            layer.self_attn
            for layer in self.model.stage_layers
            if isinstance(layer.self_attn, StateLayer)
        ]

    def holds_weight(self, name: str) -> bool:
        """Whether this pipeline stage holds the checkpoint tensor ``name`` (Hugging
        Face's name): its layers', the embedding on the first stage (and the last when the
        head shares it), the final norm and the LM head on the last."""
        match = _LAYER_INDEX.match(name)
        if match is not None:
            return self.model.start_layer <= int(match.group(1)) < self.model.end_layer
        if name.startswith("model.embed_tokens."):
            return self.model.embed_tokens is not None
        if name.startswith(("model.norm.", "lm_head.")):
            return self.lm_head is not None
        return True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named (full, unsharded) tensors; returns the parameter names filled.

        Each parameter's weight_loader keeps the slice its rank holds.
        """
        return load_named_weights(
            self,
            weights,
            self.packed_modules_mapping,
            tied_head="lm_head.weight" if self.tie_word_embeddings else None,
            rename=_skip_rotary_buffers,
        )


_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")


def _skip_rotary_buffers(name: str) -> str | None:
    # Older checkpoints saved RoPE's inverse frequencies; the model computes its own.
    return None if "rotary_emb.inv_freq" in name else name


class Qwen2ForCausalLM(LlamaForCausalLM):
    default_qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = "head"


class SmolLM3ForCausalLM(LlamaForCausalLM):
    """Llama with RoPE left out of some layers (``layer_uses_rope``)."""


class GraniteForCausalLM(LlamaForCausalLM):
    """Llama with four scales from its config: the embeddings times embedding_multiplier,
    each sublayer's output times residual_multiplier, attention_multiplier as the scores'
    scale, the logits divided by logits_scaling (read by the classes above)."""


class MistralForCausalLM(LlamaForCausalLM):
    """Llama with a sliding window where the config sets one (4096 in v0.1, null later)."""

    uses_sliding_window = True
