"""Granite 4.0-H (ibm-granite/granite-4.0-h-*, GraniteMoeHybridForCausalLM): Granite's
decoder (llama.py: its four scales) where most layers' attention is a Mamba-2 mixer with a
per-request state; the others are GQA attention, without RoPE unless
``position_embedding_type`` is "rope".

What differs from Granite:
- ``layer_types`` names each layer "mamba" ("linear_attention" in transformers 5) or
  "attention". A Mamba-2 layer projects the input to z | xBC | dt (``in_proj``), runs a
  causal conv of ``mamba_d_conv`` taps with a bias and SiLU over xBC, scans x with the
  selective state space (B, C in ``mamba_n_groups`` groups, per-head dt, A and D:
  ``kernels/ssm_kernels.py``), normalises y * silu(z) by groups (a gated RMSNorm) and
  projects back (``out_proj``). Its state: the conv's last inputs and the SSM state
  [heads, head_dim, d_state] in float32 (``state_cache.py``).
- The MLP is ``shared_mlp`` (gate and up fused in ``input_linear``), plus, where
  ``num_local_experts`` > 0, a mixture of experts (Granite MoE's block) beside it.

Tensor parallelism is refused: the mixer's groups and heads are not split yet.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from minivllm.distributed.parallel_state import TPGroup
from minivllm.kernels.conv_kernels import causal_conv1d
from minivllm.kernels.ssm_kernels import gated_rms_norm, mamba2_scan
from minivllm.model.layers.fused_moe import SparseMoeBlock, per_expert
from minivllm.model.layers.linear import Linear
from minivllm.model.layers.quantization.base import QuantizationConfig
from minivllm.model.layers.state_cache import StateLayer, StateShape
from minivllm.model.models.lfm2 import _ConfigView
from minivllm.model.models.llama import MLP, DecoderLayer, GraniteForCausalLM

_MAMBA_TYPES = ("mamba", "linear_attention")


class Mamba2Mixer(StateLayer):
    """HF's GraniteMoeHybridMambaLayer, in a layer's attention place."""

    def __init__(self, config, quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.heads = config.mamba_n_heads
        self.groups = config.mamba_n_groups
        self.d_state = config.mamba_d_state
        self.kernel_size = config.mamba_d_conv
        self.inner = int(config.mamba_expand * hidden)
        self.head_dim = config.mamba_d_head
        if self.head_dim == "auto":
            self.head_dim = self.inner // self.heads
        self.conv_dim = self.inner + 2 * self.groups * self.d_state
        self.eps = config.rms_norm_eps
        limit = getattr(config, "time_step_limit", None) or (0.0, float("inf"))
        self.dt_limit = (float(limit[0]), float(limit[1]))
        bias = bool(config.mamba_proj_bias)
        width = self.inner + self.conv_dim + self.heads
        self.in_proj = Linear(hidden, width, bias, quant_config, f"{prefix}.in_proj")
        self.out_proj = Linear(self.inner, hidden, bias, quant_config, f"{prefix}.out_proj")
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, self.kernel_size), False)
        self.conv_weight.weight_loader = self._load_conv_weight
        self.conv_bias = (
            nn.Parameter(torch.empty(self.conv_dim), False) if config.mamba_conv_bias else None
        )
        self.dt_bias = nn.Parameter(torch.empty(self.heads), False)
        self.A_log = nn.Parameter(torch.empty(self.heads), False)
        self.D = nn.Parameter(torch.empty(self.heads), False)
        self.norm_weight = nn.Parameter(torch.empty(self.inner), False)
        # float32 per-head constants, made once after loading (a step computes nothing
        # outside kernels, so its decode steps replay as CPU graphs): A = -exp(A_log).
        self.scan_constants: tuple[torch.Tensor, ...] = ()

    def process_weights_after_loading(self) -> None:
        a = -torch.exp(self.A_log.detach().float())
        self.scan_constants = (a, self.D.detach().float(), self.dt_bias.detach().float())

    def _load_conv_weight(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data.copy_(loaded.reshape(self.conv_dim, self.kernel_size))

    def state_shapes(self) -> list[StateShape]:
        return [
            StateShape((self.conv_dim, self.kernel_size - 1), self.conv_weight.dtype),
            StateShape((self.heads, self.head_dim, self.d_state), torch.float32),
        ]

    def forward(self, positions, hidden: torch.Tensor, meta) -> torch.Tensor:
        projected = self.in_proj(hidden)
        z, xbc, dt = projected.split([self.inner, self.conv_dim, self.heads], dim=-1)
        step = self.step
        if step.max_query_len == 1:  # a decode step: row i is request i
            slots, query_start_loc = self.decode_slots(hidden.shape[0]), None
        else:
            slots, query_start_loc = step.slots, step.query_start_loc
        conv_state, ssm_state = self.states
        xbc = causal_conv1d(
            xbc, self.conv_weight, self.conv_bias, conv_state, slots, query_start_loc
        )
        group_width = self.groups * self.d_state
        x, b, c = xbc.split([self.inner, group_width, group_width], dim=-1)
        a, d, dt_bias = self.scan_constants
        y = mamba2_scan(
            x, dt, a, b, c, d, dt_bias, ssm_state, slots, query_start_loc, self.dt_limit
        )
        y = gated_rms_norm(y, z, self.norm_weight, self.inner // self.groups, self.eps)
        return self.out_proj(y)


class MoeWithSharedMlp(nn.Module):
    """Granite 4.0-H's MLP with experts: the experts' sum plus the shared MLP's."""

    def __init__(self, moe: nn.Module, shared: nn.Module) -> None:
        super().__init__()
        self.moe = moe
        self.shared = shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x) + self.shared(x)


class GraniteMoeHybridForCausalLM(GraniteForCausalLM):
    supports_cuda_graphs = True
    supports_pipeline_parallel = False  # per-request state layers

    def __init__(self, config, backend, tp: TPGroup | None = None, quant_config=None) -> None:
        if tp is not None and tp.size > 1:
            raise ValueError(
                "Granite 4.0-H cannot be split by tensor parallelism yet (its Mamba-2 "
                "layers' heads and groups): use tensor_parallel_size=1"
            )
        types = config.layer_types
        rope = getattr(config, "position_embedding_type", None) == "rope"
        view = _ConfigView(
            config,
            intermediate_size=config.shared_intermediate_size,
            # layer_uses_rope reads 0 as "no RoPE in this layer".
            no_rope_layers=[int(rope)] * config.num_hidden_layers,
        )
        self.has_experts = (getattr(config, "num_local_experts", 0) or 0) > 0
        if self.has_experts:
            self.supports_cuda_graphs = False  # the experts are picked on the host
        self._mamba = [t in _MAMBA_TYPES for t in types]
        super().__init__(view, backend, tp, quant_config)

    def make_mlp(self, config, layer: int, tp, quant_config, prefix):
        if not self.has_experts:
            return None  # the shared MLP alone: Llama's, under mlp.
        moe = SparseMoeBlock(
            config.hidden_size,
            config.num_local_experts,
            config.num_experts_per_tok,
            config._config.intermediate_size,
            True,
            tp,
            quant_config,
            f"{prefix}.moe",
        )
        return MoeWithSharedMlp(moe, MLP(config, tp, quant_config, f"{prefix}.shared"))

    def make_layer(self, config, backend, tp, quant_config, layer: int, prefix: str):
        if not self._mamba[layer]:
            return None
        mixer = Mamba2Mixer(config, quant_config, f"{prefix}.self_attn")
        mlp = self.make_mlp(config, layer, tp, quant_config, f"{prefix}.mlp")
        return DecoderLayer(
            config, backend, False, None, tp, quant_config, prefix, mlp=mlp, self_attn=mixer
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(per_expert(self._renamed(weights)))

    def _renamed(self, weights) -> Iterator[tuple[str, torch.Tensor]]:
        shared = ".mlp.shared." if self.has_experts else ".mlp."
        for name, tensor in weights:
            name = name.replace(".mamba.", ".self_attn.")
            name = name.replace(".self_attn.conv1d.weight", ".self_attn.conv_weight")
            name = name.replace(".self_attn.conv1d.bias", ".self_attn.conv_bias")
            name = name.replace(".self_attn.norm.weight", ".self_attn.norm_weight")
            if ".shared_mlp.input_linear." in name:  # gate rows, then up rows
                gate, up = tensor.chunk(2, dim=0)
                prefix = name.split(".shared_mlp.")[0] + shared
                yield prefix + "gate_proj.weight", gate
                yield prefix + "up_proj.weight", up
                continue
            name = name.replace(".shared_mlp.output_linear.", shared + "down_proj.")
            if ".block_sparse_moe." in name:
                name = name.replace(".block_sparse_moe.", ".mlp.moe.")
                name = name.replace(".input_linear.weight", ".experts.gate_up_proj")
                name = name.replace(".output_linear.weight", ".experts.down_proj")
                name = name.replace(".router.layer.weight", ".gate.weight")
                name = name.replace(".router.weight", ".gate.weight")
            yield name, tensor
