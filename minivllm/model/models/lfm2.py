"""LFM2 (LiquidAI/LFM2-350M ... 2.6B): Llama's decoder where most layers' attention is a
gated short convolution with a per-request state; the others are GQA attention.

What differs from Llama:
- ``layer_types`` names each layer "conv" or "full_attention". A conv layer projects the
  input to B | C | x (``in_proj``), runs a depthwise causal convolution of ``conv_L_cache``
  taps over B * x, multiplies by C and projects back (``out_proj``). Its state is the last
  ``conv_L_cache - 1`` values of B * x per channel (``state_cache.py``), carried across
  prompt chunks and decode steps (``kernels/conv_kernels.py``).
- Attention has per-head q/k RMSNorms (Qwen3's) and an ``out_proj``.
- The MLP's width is adjusted from ``intermediate_size`` (``block_auto_adjust_ff_dim``);
  its projections are w1 (gate), w3 (up), w2 (down).
- Names: ``norm_eps``, ``operator_norm`` / ``ffn_norm`` before the two sublayers,
  ``embedding_norm`` as the final norm.

Tensor parallelism splits the convolution by channels (each rank's B, C and x slices and
their taps) as attention by heads.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from minivllm.distributed.parallel_state import TPGroup
from minivllm.kernels.conv_kernels import gated_short_conv
from minivllm.model.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from minivllm.model.layers.quantization.base import QuantizationConfig
from minivllm.model.layers.state_cache import StateLayer, StateShape
from minivllm.model.models.llama import DecoderLayer, LlamaForCausalLM


class ShortConvInProj(MergedColumnParallelLinear):
    """in_proj: B | C | x, one checkpoint tensor; each rank takes its channels of each."""

    def __init__(self, dim: int, bias: bool, tp: TPGroup, quant_config, prefix: str) -> None:
        super().__init__(dim, {0: dim, 1: dim, 2: dim}, bias, tp, quant_config, prefix)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if shard_id is not None:
            super().weight_loader(param, loaded, shard_id)
            return
        dim = loaded.shape[0] // 3
        for i in range(3):
            super().weight_loader(param, loaded.narrow(0, i * dim, dim), i)


class ShortConv(StateLayer):
    """LFM2's gated short convolution (HF's Lfm2ShortConv), in a layer's attention place."""

    def __init__(
        self, config, tp: TPGroup, quant_config: QuantizationConfig | None, prefix: str
    ) -> None:
        super().__init__()
        dim = config.hidden_size
        bias = bool(getattr(config, "conv_bias", False))
        self.kernel_size = config.conv_L_cache
        self.in_proj = ShortConvInProj(dim, bias, tp, quant_config, f"{prefix}.in_proj")
        self.out_proj = RowParallelLinear(dim, dim, bias, tp, quant_config, f"{prefix}.out_proj")
        self.dim = dim // tp.size  # this rank's channels (in_proj checked the split)
        self.tp = tp
        # HF's Conv1d weight [D, 1, K] as [D, K]: this rank's channels.
        self.conv_weight = nn.Parameter(torch.empty(self.dim, self.kernel_size), False)
        self.conv_weight.weight_loader = self._load_conv_weight
        self.conv_bias = None
        if bias:
            raise ValueError("LFM2 with conv_bias=True is not supported (no released model)")

    def _load_conv_weight(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        loaded = loaded.reshape(-1, self.kernel_size)
        param.data.copy_(loaded.narrow(0, self.tp.rank * self.dim, self.dim))

    def state_shapes(self) -> list[StateShape]:
        return [StateShape((self.dim, self.kernel_size - 1), self.conv_weight.dtype)]

    def forward(self, positions, hidden: torch.Tensor, meta) -> torch.Tensor:
        bcx = self.in_proj(hidden)
        step = self.step
        if step.max_query_len == 1:  # a decode step: row i is request i
            slots, query_start_loc = self.decode_slots(hidden.shape[0]), None
        else:
            slots, query_start_loc = step.slots, step.query_start_loc
        y = gated_short_conv(bcx, self.conv_weight, self.states[0], slots, query_start_loc)
        return self.out_proj(y)


class _ConfigView:
    """The HF config read through Llama's field names (the config itself is not changed)."""

    def __init__(self, config, **overrides) -> None:
        self._config = config
        self.__dict__.update(overrides)

    def __getattr__(self, name: str):
        return getattr(self._config, name)


def mlp_width(config) -> int:
    """HF's Lfm2MLP width: 2/3 of intermediate_size, times the multiplier, rounded up to a
    multiple of block_multiple_of (when block_auto_adjust_ff_dim)."""
    width = config.intermediate_size
    if getattr(config, "block_auto_adjust_ff_dim", False):
        width = int(2 * width / 3)
        multiplier = getattr(config, "block_ffn_dim_multiplier", None)
        if multiplier is not None:
            width = int(multiplier * width)
            multiple = config.block_multiple_of
            width = multiple * ((width + multiple - 1) // multiple)
    return width


# HF checkpoint names -> Llama's.
_RENAMES = [
    (re.compile(r"\.self_attn\.out_proj\."), ".self_attn.o_proj."),  # before conv's
    (re.compile(r"^(model\.layers\.\d+)\.conv\.conv\.weight$"), r"\1.self_attn.conv_weight"),
    (re.compile(r"^(model\.layers\.\d+)\.conv\."), r"\1.self_attn."),
    (re.compile(r"\.self_attn\.q_layernorm\."), ".self_attn.q_norm."),
    (re.compile(r"\.self_attn\.k_layernorm\."), ".self_attn.k_norm."),
    (re.compile(r"\.operator_norm\."), ".input_layernorm."),
    (re.compile(r"\.ffn_norm\."), ".post_attention_layernorm."),
    (re.compile(r"\.feed_forward\.w1\."), ".mlp.gate_proj."),
    (re.compile(r"\.feed_forward\.w3\."), ".mlp.up_proj."),
    (re.compile(r"\.feed_forward\.w2\."), ".mlp.down_proj."),
    (re.compile(r"^model\.embedding_norm\."), "model.norm."),
]


def _llama_name(name: str) -> str:
    for pattern, replacement in _RENAMES:
        name = pattern.sub(replacement, name)
    return name


class Lfm2ForCausalLM(LlamaForCausalLM):
    qk_norm = "head"
    supports_pipeline_parallel = False  # per-request state layers

    def __init__(self, config, backend, tp=None, quant_config=None) -> None:
        view = _ConfigView(
            config,
            rms_norm_eps=config.norm_eps,
            intermediate_size=mlp_width(config),
            attention_bias=False,
        )
        super().__init__(view, backend, tp, quant_config)

    def make_layer(self, config, backend, tp, quant_config, layer: int, prefix: str):
        if config.layer_types[layer] != "conv":
            return None
        conv = ShortConv(config, tp, quant_config, f"{prefix}.self_attn")
        return DecoderLayer(config, backend, False, None, tp, quant_config, prefix, self_attn=conv)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights((_llama_name(name), t) for name, t in weights)
