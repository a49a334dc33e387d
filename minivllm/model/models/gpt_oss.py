"""gpt-oss (openai/gpt-oss-20b, -120b): a mixture-of-experts decoder with attention sinks.

Each layer is Llama's pre-norm layout with:
- attention with biases on q, k, v and o, YaRN RoPE, and a learned sink per query head (a
  logit that joins the softmax's denominator with no value: attention/backend.py); the
  layers alternate between a sliding window (``layer_types``: even layers, 128 tokens in
  the released configs) and full attention;
- a router with a bias (``mlp.router``) choosing ``num_experts_per_tok`` of
  ``num_local_experts`` experts, weighted by the softmax over the chosen logits (the
  renormalised softmax over all of them: the same weights); each expert is
  down((up + 1) * glu(gate)) with biases, gate and up clamped at ``swiglu_limit``
  (activation.py's SwigluOAIAndMul).

Checkpoints hold the experts fused, as transformers does: ``mlp.experts.gate_up_proj``
[E, H, 2I] with the gate and up columns interleaved, ``gate_up_proj_bias`` [E, 2I],
``down_proj`` [E, I, H], ``down_proj_bias`` [E, H]; the released ones keep the expert
matrices in MXFP4 (``*_blocks``, ``*_scales``; quantization/mxfp4.py), dequantized at load.
They load under the per-expert names of fused_moe.py; where the quantization config keeps
MXFP4 (quantization "gguf", inferred for such a checkpoint on the CPU: the GGUF kernels),
the matrices stay quantized.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from minivllm.distributed.parallel_state import TPGroup
from minivllm.model.layers.activation import SwigluOAIAndMul
from minivllm.model.layers.attention import Attention
from minivllm.model.layers.fused_moe import FusedMoE
from minivllm.model.layers.linear import Linear, QKVParallelLinear, RowParallelLinear
from minivllm.model.layers.quantization.base import QuantizationConfig, QuantizedTensor
from minivllm.model.layers.quantization.mxfp4 import mxfp4_matrix
from minivllm.model.layers.rotary import get_rope, rope_parameters
from minivllm.model.models.llama import DecoderLayer, LlamaForCausalLM


class GptOssAttention(nn.Module):
    def __init__(
        self,
        config,
        backend,
        tp: TPGroup,
        quant_config: QuantizationConfig | None,
        prefix: str,
        sliding_window: int | None,
    ) -> None:
        super().__init__()
        total_heads = config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // total_heads
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            total_heads,
            config.num_key_value_heads,
            True,
            tp,
            quant_config,
            f"{prefix}.qkv_proj",
        )
        self.num_heads = self.qkv_proj.num_heads
        self.o_proj = RowParallelLinear(
            total_heads * self.head_dim, config.hidden_size, True, tp, quant_config,
            f"{prefix}.o_proj",
        )  # fmt: skip
        # This rank's heads' sinks; loaded from the checkpoint's self_attn.sinks.
        sinks = nn.Parameter(torch.zeros(self.num_heads), requires_grad=False)
        first = tp.rank * self.num_heads
        sinks.weight_loader = lambda param, loaded: param.data.copy_(
            loaded[first : first + self.num_heads]
        )
        rotary = get_rope(
            self.head_dim, config.max_position_embeddings, rope_parameters(config), torch.float32
        )
        self.attn = Attention(
            self.num_heads,
            self.qkv_proj.num_kv_heads,
            self.head_dim,
            self.head_dim**-0.5,
            backend,
            rotary,
            sliding_window=sliding_window,
            sinks=sinks,
        )

    def forward(self, positions, hidden, meta) -> torch.Tensor:
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k, v = self.qkv_proj(hidden).split([q_size, kv_size, kv_size], dim=-1)
        return self.o_proj(self.attn(positions, q, k, v, meta))


class GptOssMoE(nn.Module):
    """The router (with a bias, replicated) and the experts."""

    def __init__(
        self, config, tp: TPGroup, quant_config: QuantizationConfig | None, prefix: str
    ) -> None:
        super().__init__()
        experts = config.num_local_experts
        self.router = Linear(config.hidden_size, experts, True, quant_config, f"{prefix}.router")
        self.experts = FusedMoE(
            experts,
            config.num_experts_per_tok,
            config.hidden_size,
            config.intermediate_size,
            True,
            tp,
            quant_config,
            f"{prefix}.experts",
            bias=True,
            act_fn=SwigluOAIAndMul(
                getattr(config, "swiglu_alpha", 1.702), getattr(config, "swiglu_limit", 7.0)
            ),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.router(x))


class GptOssForCausalLM(LlamaForCausalLM):
    supports_cuda_graphs = False  # the experts are picked on the host (fused_moe.py)
    supports_pipeline_parallel = False  # builds every layer in its own __init__

    def __init__(self, config, backend, tp=None, quant_config=None) -> None:
        super().__init__(config, backend, tp, quant_config)
        self.mxfp4_format = quant_config  # keeps the MXFP4 matrices where it takes them

    def make_layer(self, config, backend, tp, quant_config, layer: int, prefix: str):
        """Llama's layer with gpt-oss's attention (windowed on the layers layer_types says,
        by default the even ones) and experts."""
        types = getattr(config, "layer_types", None)
        sliding = types[layer] == "sliding_attention" if types else layer % 2 == 0
        window = config.sliding_window if sliding else None
        attn = GptOssAttention(config, backend, tp, quant_config, f"{prefix}.self_attn", window)
        moe = GptOssMoE(config, tp, quant_config, f"{prefix}.mlp")
        return DecoderLayer(
            config, backend, True, None, tp, quant_config, prefix, mlp=moe, self_attn=attn
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(per_expert_gpt_oss(weights, self.mxfp4_format))


def per_expert_gpt_oss(
    weights: Iterable[tuple[str, torch.Tensor]], quant_config: QuantizationConfig | None = None
) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """The fused expert tensors (dense, or MXFP4 blocks and scales) cut into fused_moe.py's
    per-expert names (MXFP4 matrices kept in quant_config's format where it takes them,
    else dequantized); the sinks under the attention layer's name; the rest as they
    are."""
    blocks: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if name.endswith(".self_attn.sinks"):
            yield name.replace(".self_attn.sinks", ".self_attn.attn.sinks"), tensor
        elif name.endswith(("_proj_blocks", "_proj_scales")):
            # MXFP4: a matrix comes as two tensors, in either order.
            matrix, part = name.rsplit("_", 1)
            other = blocks.pop(f"{matrix}_{'scales' if part == 'blocks' else 'blocks'}", None)
            if other is None:
                blocks[name] = tensor
                continue
            packed, scales = (tensor, other) if part == "blocks" else (other, tensor)
            yield from _mxfp4_experts(matrix, packed, scales, quant_config)
        elif name.endswith(_FUSED_EXPERT_TENSORS):
            yield from _expert_tensors(name, tensor)
        else:
            yield name, tensor
    if blocks:
        raise ValueError(f"MXFP4 blocks without their scales: {sorted(blocks)[:3]}")


# transformers' fused expert tensors (the matrices and their biases).
_FUSED_EXPERT_TENSORS = (
    "experts.gate_up_proj",
    "experts.down_proj",
    "experts.gate_up_proj_bias",
    "experts.down_proj_bias",
)


def _expert_tensors(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """One fused tensor [E, ...] as each expert's: gate_up_proj [E, H, 2I] (gate and up
    columns interleaved) -> gate_proj.weight [I, H] and up_proj.weight; down_proj [E, I, H]
    -> down_proj.weight [H, I]; their biases alike."""
    experts, fused = name.rsplit(".", 1)
    is_bias = fused.endswith("_bias")
    fused = fused.removesuffix("_bias")
    kind = "bias" if is_bias else "weight"
    for e, t in enumerate(tensor):
        if fused == "gate_up_proj":
            yield f"{experts}.{e}.gate_proj.{kind}", (t[0::2] if is_bias else t[:, 0::2].T)
            yield f"{experts}.{e}.up_proj.{kind}", (t[1::2] if is_bias else t[:, 1::2].T)
        else:
            yield f"{experts}.{e}.down_proj.{kind}", (t if is_bias else t.T)


def _mxfp4_experts(
    name: str, blocks: torch.Tensor, scales: torch.Tensor, quant_config
) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """MXFP4 blocks [E, rows, K / 32, 16] and scales [E, rows, K / 32] (gate_up's rows: gate
    and up interleaved) as each expert's matrices [rows, K]."""
    experts, fused = name.rsplit(".", 1)
    parts = {"down_proj": slice(None)}
    if fused != "down_proj":
        parts = {"gate_proj": slice(0, None, 2), "up_proj": slice(1, None, 2)}
    for e in range(blocks.shape[0]):
        for proj, rows in parts.items():
            matrix = mxfp4_matrix(blocks[e, rows], scales[e, rows], quant_config)
            yield f"{experts}.{e}.{proj}.weight", matrix
