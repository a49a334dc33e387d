"""Gemma 4's language model (``Gemma4ForCausalLM``; the multimodal checkpoints served as it).

What differs from Gemma 3:
- RMS norms scale by their weight (not 1 + weight); q and k are normed per head, v too
  (without a scale), and the attention scale is 1;
- global layers have their own head size and KV heads (``per_layer_config``), turn only a
  part of each head (``proportional`` RoPE) and, with ``attention_k_eq_v``, take their
  values from the key projection (before its norm);
- the last ``num_kv_shared_layers`` layers have no K/V of their own: each attends over the
  keys and values of the last earlier layer of its kind (``kv_sharing_target``), and with
  ``use_double_wide_mlp`` its MLP is twice as wide;
- per-layer embeddings (PLE, the E2B/E4B models): a second embedding table gives each token
  a small vector per layer, mixed with a projection of its embedding; each layer gates its
  output with it and adds the result to the residual stream;
- with ``enable_moe_block`` (26B-A4B) a mixture of experts runs beside each layer's MLP,
  routed from the residual stream (a scale-free norm, a learned scale, softmax, top k,
  renormalised, times a per-expert scale), each branch normed before the two are added;
- every layer's output is multiplied by its ``layer_scalar``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from minivllm.attention.backend import AttentionBackend
from minivllm.distributed.parallel_state import TPGroup
from minivllm.model.layers.activation import GeluAndMul
from minivllm.model.layers.attention import Attention
from minivllm.model.layers.embedding import VocabParallelEmbedding
from minivllm.model.layers.fused_moe import FusedMoE, per_expert
from minivllm.model.layers.linear import (
    ColumnParallelLinear,
    Linear,
    QKVParallelLinear,
    RowParallelLinear,
)
from minivllm.model.layers.norm import Gemma4RMSNorm
from minivllm.model.layers.quantization.base import QuantizationConfig
from minivllm.model.layers.rotary import get_rope, rope_parameters
from minivllm.model.models.gemma3 import Gemma3ForCausalLM, Gemma3MLP, TextOfMultimodal

SLIDING, FULL = "sliding_attention", "full_attention"


def kv_sharing_targets(config) -> list[int | None]:
    """For each layer, the layer whose K/V it attends over (None: its own): from
    ``num_kv_shared_layers`` from the end, the last earlier non-sharing layer of its kind."""
    kinds = list(config.layer_types)
    first_shared = len(kinds) - (getattr(config, "num_kv_shared_layers", 0) or 0)
    if first_shared <= 0:
        raise ValueError("Gemma 4 with every layer sharing KV is not supported")
    targets: list[int | None] = []
    for i, kind in enumerate(kinds):
        if i < first_shared:
            targets.append(None)
            continue
        earlier = [j for j in range(first_shared) if kinds[j] == kind]
        if not earlier:
            raise ValueError(f"no earlier {kind} layer holds the K/V that layer {i} shares")
        targets.append(earlier[-1])
    return targets


def _layer_shape(config, layer: int) -> tuple[int, int]:
    """(head_dim, num_key_value_heads) of a layer: global layers have their own, which
    transformers' per-layer view of the config gives."""
    layer_config = config.per_layer_config[layer]
    return layer_config.head_dim, layer_config.num_key_value_heads


class Gemma4Attention(nn.Module):
    def __init__(
        self,
        config,
        layer: int,
        backend: AttentionBackend,
        tp: TPGroup,
        quant_config: QuantizationConfig | None,
        prefix: str,
        kv_sharing_target: Attention | None,
    ) -> None:
        super().__init__()
        kind = config.layer_types[layer]
        self.head_dim, total_kv_heads = _layer_shape(config, layer)
        total_heads, hidden = config.num_attention_heads, config.hidden_size
        bias = getattr(config, "attention_bias", False)
        eps = config.rms_norm_eps
        self.reads_shared_kv = kv_sharing_target is not None
        if self.reads_shared_kv:  # queries only
            self.q_proj = ColumnParallelLinear(
                hidden, total_heads * self.head_dim, bias, tp, quant_config, f"{prefix}.q_proj"
            )
            self.num_heads = self.q_proj.output_size_per_partition // self.head_dim
            self.num_kv_heads = kv_sharing_target.num_kv_heads
        else:
            # With attention_k_eq_v the values are the key projection's output: the loader
            # gives the k weight to the v shard too (see load_weights).
            self.qkv_proj = QKVParallelLinear(
                hidden,
                self.head_dim,
                total_heads,
                total_kv_heads,
                bias,
                tp,
                quant_config,
                f"{prefix}.qkv_proj",
            )
            self.num_heads = self.qkv_proj.num_heads
            self.num_kv_heads = self.qkv_proj.num_kv_heads
            self.k_norm = Gemma4RMSNorm(self.head_dim, eps)
            self.v_norm = Gemma4RMSNorm(self.head_dim, eps, has_weight=False)
        self.q_norm = Gemma4RMSNorm(self.head_dim, eps)
        self.o_proj = RowParallelLinear(
            total_heads * self.head_dim, hidden, bias, tp, quant_config, f"{prefix}.o_proj"
        )
        rotary = get_rope(
            self.head_dim, config.max_position_embeddings, rope_parameters(config, kind)
        )
        self.attn = Attention(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            1.0,  # q is normed
            backend,
            rotary,
            sliding_window=config.sliding_window if kind == SLIDING else None,
            kv_sharing_target=kv_sharing_target,
        )

    def forward(self, positions, hidden, meta) -> torch.Tensor:
        if self.reads_shared_kv:
            q = self.q_norm(self.q_proj(hidden).view(-1, self.num_heads, self.head_dim))
            return self.o_proj(self.attn(positions, q, None, None, meta))
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k, v = self.qkv_proj(hidden).split([q_size, kv_size, kv_size], dim=-1)
        q = self.q_norm(q.view(-1, self.num_heads, self.head_dim))
        k = self.k_norm(k.view(-1, self.num_kv_heads, self.head_dim))
        v = self.v_norm(v.view(-1, self.num_kv_heads, self.head_dim))
        return self.o_proj(self.attn(positions, q, k, v, meta))


class Gemma4Router(nn.Module):
    """The router's logits from the residual stream: norm (no weight) * scale /
    sqrt(hidden), projected. The experts take the top k of their softmax, renormalised,
    times each chosen one's scale (HF's router.per_expert_scale, held by FusedMoE)."""

    def __init__(self, config, quant_config, prefix: str) -> None:
        super().__init__()
        hidden, experts = config.hidden_size, config.num_experts
        self.norm = Gemma4RMSNorm(hidden, config.rms_norm_eps, has_weight=False)
        self.proj = Linear(hidden, experts, False, quant_config, f"{prefix}.proj")
        self.scale = nn.Parameter(torch.empty(hidden), requires_grad=False)
        self.root_size = hidden**-0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In place, in HF's order: a CPU graph replays ops that write a given tensor.
        return self.proj(self.norm(x).mul_(self.scale).mul_(self.root_size))


class Gemma4DecoderLayer(nn.Module):
    def __init__(
        self,
        config,
        layer: int,
        backend,
        tp: TPGroup,
        quant_config: QuantizationConfig | None,
        prefix: str,
        kv_sharing_target: Attention | None,
    ) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma4Attention(
            config, layer, backend, tp, quant_config, f"{prefix}.self_attn", kv_sharing_target
        )
        wide = getattr(config, "use_double_wide_mlp", False) and kv_sharing_target is not None
        size = config.intermediate_size * (2 if wide else 1)
        self.mlp = Gemma3MLP(config, tp, quant_config, f"{prefix}.mlp", size)
        self.input_layernorm = Gemma4RMSNorm(hidden, eps)
        self.post_attention_layernorm = Gemma4RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(hidden, eps)
        self.post_feedforward_layernorm = Gemma4RMSNorm(hidden, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)
        self.router = self.experts = None
        if getattr(config, "enable_moe_block", False):
            self.router = Gemma4Router(config, quant_config, f"{prefix}.router")
            self.experts = FusedMoE(
                config.num_experts,
                config.top_k_experts,
                hidden,
                config.moe_intermediate_size,
                True,
                tp,
                quant_config,
                f"{prefix}.experts",
                act_fn=GeluAndMul("tanh"),
                expert_scale=True,
            )
            self.pre_feedforward_layernorm_2 = Gemma4RMSNorm(hidden, eps)
            self.post_feedforward_layernorm_1 = Gemma4RMSNorm(hidden, eps)
            self.post_feedforward_layernorm_2 = Gemma4RMSNorm(hidden, eps)
        self.per_layer_input_gate = None
        per_layer = getattr(config, "hidden_size_per_layer_input", 0)
        if per_layer:  # replicated: small
            self.per_layer_input_gate = Linear(
                hidden, per_layer, False, quant_config, f"{prefix}.per_layer_input_gate"
            )
            self.per_layer_projection = Linear(
                per_layer, hidden, False, quant_config, f"{prefix}.per_layer_projection"
            )
            self.post_per_layer_input_norm = Gemma4RMSNorm(hidden, eps)

    def forward(self, positions, hidden, meta, per_layer_input=None) -> torch.Tensor:
        """hidden: the residual stream, which this layer updates in place (ops that write
        a given tensor: a CPU graph replays them)."""
        attn = self.self_attn(positions, self.input_layernorm(hidden), meta)
        hidden += self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        if self.experts is not None:
            logits = self.router(hidden)
            moe = self.experts(self.pre_feedforward_layernorm_2(hidden), logits)
            mlp = self.post_feedforward_layernorm_1(mlp)
            mlp += self.post_feedforward_layernorm_2(moe)
        hidden += self.post_feedforward_layernorm(mlp)
        if self.per_layer_input_gate is not None:
            gate = self.per_layer_input_gate(hidden)
            torch.ops.aten.gelu.out(gate, approximate="tanh", out=gate)
            mixed = self.per_layer_projection(gate.mul_(per_layer_input))
            hidden += self.post_per_layer_input_norm(mixed)
        return hidden.mul_(self.layer_scalar)


class Gemma4Model(nn.Module):
    def __init__(self, config, backend, tp: TPGroup, quant_config, prefix: str = "model"):
        super().__init__()
        if getattr(config, "use_bidirectional_attention", None) == "all":
            raise ValueError("Gemma 4 with bidirectional attention (an encoder) is not supported")
        hidden = config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden, tp, quant_config)
        layers: list[Gemma4DecoderLayer] = []
        targets = kv_sharing_targets(config)
        for i, target in enumerate(targets):
            shared = layers[target].self_attn.attn if target is not None else None
            layers.append(
                Gemma4DecoderLayer(
                    config, i, backend, tp, quant_config, f"{prefix}.layers.{i}", shared
                )
            )
        self.layers = nn.ModuleList(layers)
        # The first layer that reads an earlier one's K/V.
        self.first_sharing = next((i for i, t in enumerate(targets) if t is not None), None)
        self.norm = Gemma4RMSNorm(hidden, config.rms_norm_eps)
        # HF multiplies by sqrt(hidden) cast to the weights' dtype (2.0 bits of bf16 matter).
        self.register_buffer("normalizer", torch.tensor(hidden**0.5), persistent=False)
        self.per_layer = getattr(config, "hidden_size_per_layer_input", 0) or 0
        if self.per_layer:
            num_layers = config.num_hidden_layers
            self.embed_tokens_per_layer = VocabParallelEmbedding(
                config.vocab_size_per_layer_input, num_layers * self.per_layer, tp, quant_config
            )
            self.per_layer_model_projection = Linear(
                hidden,
                num_layers * self.per_layer,
                False,
                quant_config,
                f"{prefix}.per_layer_model_projection",
            )
            self.per_layer_projection_norm = Gemma4RMSNorm(self.per_layer, config.rms_norm_eps)
            self.register_buffer(
                "per_layer_normalizer", torch.tensor(self.per_layer**0.5), persistent=False
            )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """What the token ids give the layers: the scaled embeddings [T, hidden], and with
        per-layer embeddings their scaled rows beside them, [T, hidden + layers * width]
        (all that depends on the ids alone: a CPU graph's input)."""
        embed = self.embed_tokens(input_ids)
        embed = embed * self.normalizer.to(embed.dtype)
        if not self.per_layer:
            return embed
        tokens = self.embed_tokens_per_layer(input_ids)
        tokens = tokens * self.per_layer_normalizer.to(tokens.dtype)
        return torch.cat([embed, tokens], dim=-1)

    def per_layer_inputs(self, embeds: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """[tokens, layers, width]: the mean of the token's per-layer embeddings and the
        normed projection of its embedding, scaled as HF's (in place, as the layers)."""
        shape = (embeds.shape[0], len(self.layers), self.per_layer)
        projected = self.per_layer_model_projection(embeds).mul_(embeds.shape[-1] ** -0.5)
        projected = self.per_layer_projection_norm(projected.view(shape))
        return projected.add_(tokens.view(shape)).mul_(2.0**-0.5)

    def forward(
        self, input_ids, positions, meta, inputs_embeds=None, fast_prefill=None
    ) -> torch.Tensor:
        """inputs_embeds: embed_input_ids' output for the ids (a CPU graph's static input,
        rewritten every replay); the layers add to the residual stream in place.

        fast_prefill (rows, metadata): the layers that read earlier layers' K/V run on
        those rows alone, with that metadata (the runner's, see ModelRunner._fast_prefill);
        the other rows' outputs are left as the last layer with K/V of its own made them."""
        if inputs_embeds is None:
            inputs_embeds = self.embed_input_ids(input_ids)
        hidden, per_layer = inputs_embeds, None
        if self.per_layer:
            width = self.embed_tokens.hidden_size
            hidden = torch.empty_like(inputs_embeds[:, :width]).copy_(inputs_embeds[:, :width])
            per_layer = self.per_layer_inputs(hidden, inputs_embeds[:, width:])
        layers = list(self.layers)
        if fast_prefill is not None and self.first_sharing is not None:
            layers, shared = layers[: self.first_sharing], layers[self.first_sharing :]
        for i, layer in enumerate(layers):
            layer_input = per_layer[:, i] if per_layer is not None else None
            hidden = layer(positions, hidden, meta, layer_input)
        if len(layers) < len(self.layers):
            rows, rows_meta = fast_prefill
            if rows_meta is not None:  # else no row is sampled: nothing to compute
                hidden[rows] = self._shared_layers(
                    shared, rows, rows_meta, hidden, positions, per_layer
                )
        return self.norm(hidden)

    def _shared_layers(self, shared, rows, meta, hidden, positions, per_layer) -> torch.Tensor:
        """The layers that read earlier layers' K/V, on rows alone (fast_prefill): the K/V
        they read are cut to those rows too (their slots, which they write again)."""
        for layer in self.layers[: self.first_sharing]:
            attn = layer.self_attn.attn
            if attn.keeps_kv:
                attn.last_kv = tuple(t[rows] for t in attn.last_kv)
        hidden, positions = hidden[rows], positions[rows]
        first = self.first_sharing
        for i, layer in enumerate(shared, start=first):
            layer_input = per_layer[rows, i] if per_layer is not None else None
            hidden = layer(positions, hidden, meta, layer_input)
        return hidden


class Gemma4ForCausalLM(Gemma3ForCausalLM):
    """Gemma 3's head, soft cap and names, over Gemma 4's layers."""

    def __init__(
        self,
        config,
        backend: AttentionBackend,
        tp: TPGroup | None = None,
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        super().__init__(config, backend, tp, quant_config)
        # Routing reads which experts got tokens on the host (see layers/fused_moe.py).
        self.supports_cuda_graphs = not getattr(config, "enable_moe_block", False)
        # For the runner's kv_sharing_fast_prefill.
        self.shares_kv_cache = self.model.first_sharing is not None

    def make_model(self, config, backend, tp: TPGroup, quant_config) -> nn.Module:
        return Gemma4Model(config, backend, tp, quant_config)

    def forward(
        self, input_ids, positions, meta, inputs_embeds=None, fast_prefill=None
    ) -> torch.Tensor:
        return self.model(input_ids, positions, meta, inputs_embeds, fast_prefill)

    def attention_layers(self) -> list[Attention]:
        """The layers that hold a KV cache (not those sharing another's)."""
        attns = super().attention_layers()
        return [attn for attn in attns if attn.kv_sharing_target is None]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._own_names(per_expert(weights)))

    def _own_names(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """With attention_k_eq_v, a global layer's k_proj is its v_proj too; K/V weights of
        layers sharing another's K/V, which some files hold, are not used (nor by HF); the
        router's per-expert scale is the experts'."""
        k_eq_v = getattr(self.config, "attention_k_eq_v", False)
        sharing = kv_sharing_targets(self.config)
        for name, tensor in weights:
            name = name.replace(".router.per_expert_scale", ".experts.expert_scale")
            layer = int(name.split(".layers.")[1].split(".")[0]) if ".layers." in name else None
            if layer is not None and sharing[layer] is not None and _is_kv_weight(name):
                continue
            yield name, tensor
            if k_eq_v and name.endswith(".self_attn.k_proj.weight"):
                if self.config.layer_types[layer] == FULL:
                    yield name.replace(".k_proj.", ".v_proj."), tensor


def _is_kv_weight(name: str) -> bool:
    return any(f".self_attn.{part}." in name for part in ("k_proj", "v_proj", "k_norm", "v_norm"))


class Gemma4ForConditionalGeneration(TextOfMultimodal, Gemma4ForCausalLM):
    """Gemma 4 checkpoints with vision and audio towers."""
