"""Qwen3-Next (``Qwen3NextForCausalLM``): a hybrid of Gated DeltaNet linear attention and
gated full attention (one layer in four, ``layer_types``), on Qwen3-MoE's sparse MLPs with
a shared expert (qwen3_moe.py, qwen2_moe.py). What differs from Llama (llama.py):

- Gated DeltaNet layers (``GatedDeltaNet``) keep a fixed-size state per request in the
  state cache (model/layers/state_cache.py) instead of K/V: the last ``kernel - 1`` inputs
  of a depthwise causal convolution over q/k/v (SiLU after it) and a [Dk, Dv] matrix per
  value head that the gated delta rule updates token by token (kernels/gated_delta_*:
  C on the CPU, Triton on the GPU, torch otherwise). The output is RMS-normed per head,
  gated by SiLU(z), and projected back.
- Full-attention layers (``GatedAttention``) project q with a gate beside each head (q_proj
  holds [q_h | gate_h] per head), RMS-norm q and k per head, turn only the first
  ``partial_rotary_factor`` of each head (RoPE), and multiply the output by sigmoid(gate).
- Every RMSNorm but the DeltaNet's stores its weight as an offset from 1 (zero-centred:
  ``GemmaRMSNorm``).

Checkpoints name the DeltaNet's input projections per key head, interleaved
(``in_proj_qkvz``: [q | k | v | z] of each key head's group; ``in_proj_ba``: [b | a]);
loading reorders them into Qwen3.5's layout (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``,
``in_proj_a``: all heads of q, then of k, ...), which qwen3_5.py's checkpoints hold; this
engine fuses them into two projections (q/k/v/z, and b/a).

One rank only: the DeltaNet's heads are not split across tensor-parallel ranks.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from minivllm import envs, kernels
from minivllm.distributed.parallel_state import TPGroup
from minivllm.kernels import cpu_kernels, gated_delta_cpu, gated_delta_torch
from minivllm.kernels.conv_kernels import causal_conv1d
from minivllm.model.layers.attention import Attention
from minivllm.model.layers.linear import (
    Linear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
)
from minivllm.model.layers.norm import GemmaRMSNorm
from minivllm.model.layers.quantization.base import QuantizationConfig
from minivllm.model.layers.rotary import get_rope, rope_parameters
from minivllm.model.layers.state_cache import StateLayer, StateShape
from minivllm.model.models.llama import MLP, LlamaForCausalLM
from minivllm.model.models.qwen3_moe import QwenMoeMixin

_PROMPT_CHUNK = 64  # the torch path's chunk (HF's)
_MAX_DECODE_ROWS = 512  # rows of a decode step whose bounds are made ahead


def _gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float):
    """weight * norm(x) * silu(gate) per head (x, gate [T, H, D]), in float32 as HF."""
    dtype = x.dtype
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return (weight * normed * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(StateLayer):
    """The linear-attention token mixer (see the module docstring); its state per request:
    the convolution's last inputs [conv_dim, kernel - 1] and the rule's [Hv, Dk, Dv]."""

    def __init__(self, config, quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        self.num_k_heads = config.linear_num_key_heads
        self.num_v_heads = config.linear_num_value_heads
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        # HF pairs value head j with key head j // ratio ("grouped"); llama.cpp's GGUF files
        # hold the value heads reordered so that j pairs with j % num_k_heads ("tiled").
        # Tiled, q and k are repeated whole per value head, so every kernel (C, Triton,
        # torch) sees one key head per value head and needs no order of its own.
        order = getattr(config, "linear_value_head_order", "grouped")
        self.tiled_value_heads = order == "tiled" and self.num_v_heads != self.num_k_heads
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel_size = config.linear_conv_kernel_dim
        self.eps = config.rms_norm_eps
        # One product for q/k/v (the convolution's input) and z (the output gate), one for
        # b and a (the gating): GGUF files keep b and a unquantized beside quantized q/k/v/z,
        # and apart each runs its own type's kernel (one fused weight of both kinds would
        # multiply its float32 rows through torch, which a CPU graph replays from Python).
        self.in_proj_qkvz = MergedColumnParallelLinear(
            config.hidden_size,
            {"qkv": self.conv_dim, "z": self.value_dim},
            quant_config=quant_config,
            prefix=f"{prefix}.in_proj_qkvz",
        )
        self.in_proj_ba = MergedColumnParallelLinear(
            config.hidden_size,
            {"b": self.num_v_heads, "a": self.num_v_heads},
            quant_config=quant_config,
            prefix=f"{prefix}.in_proj_ba",
        )
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, self.kernel_size, groups=self.conv_dim, bias=False
        ).requires_grad_(False)
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        self.norm = _GatedNormWeight(self.head_v_dim)
        self.out_proj = Linear(
            self.value_dim, config.hidden_size, False, quant_config, f"{prefix}.out_proj"
        )
        self.kernels = gated_delta_cpu.load_kernel()
        self._decode_starts: dict[str, torch.Tensor] = {}  # by device (see _starts)

    def state_shapes(self) -> list[StateShape]:
        dtype = torch.get_default_dtype()
        return [
            StateShape((self.conv_dim, self.kernel_size - 1), dtype),
            StateShape((self.num_v_heads, self.head_k_dim, self.head_v_dim), torch.float32),
        ]

    def forward(self, positions, hidden: torch.Tensor, meta) -> torch.Tensor:
        step = self.step
        conv_state, rule_state = self.states
        num_tokens = hidden.shape[0]
        decode = step.max_query_len == 1
        slots = self.decode_slots(num_tokens) if decode else step.slots
        mixed, z = self.in_proj_qkvz(hidden).split([self.conv_dim, self.value_dim], dim=-1)
        b, a = self.in_proj_ba(hidden).split(self.num_v_heads, dim=-1)
        # SiLU of the depthwise causal convolution, from each request's last inputs.
        mixed = causal_conv1d(
            mixed, self.conv1d.weight[:, 0], None, conv_state, slots,
            None if decode else step.query_start_loc,
        )  # fmt: skip
        q = mixed[:, : self.key_dim].view(num_tokens, self.num_k_heads, self.head_k_dim)
        k = mixed[:, self.key_dim : 2 * self.key_dim].view(q.shape)
        v = mixed[:, 2 * self.key_dim :].view(num_tokens, self.num_v_heads, self.head_v_dim)
        z = z.reshape(num_tokens, self.num_v_heads, self.head_v_dim)
        c_kernels = self.kernels is not None and cpu_kernels.is_cpu_f32(q, v, a, rule_state)
        if c_kernels:  # the rule, and the gated norm of each head's output in the same call
            out = gated_delta_cpu.gated_delta_rule(
                self.kernels, q, k, v, a, b, self.A_log, self.dt_bias, rule_state,
                None if decode else step.query_start_loc, slots,
                tiled=self.tiled_value_heads, norm_gate=z, norm_weight=self.norm.weight,
                eps=self.eps,
            )  # fmt: skip
        else:
            if self.tiled_value_heads:
                ratio = self.num_v_heads // self.num_k_heads
                q, k = q.repeat(1, ratio, 1), k.repeat(1, ratio, 1)
            starts = self._starts(num_tokens, hidden.device) if decode else step.query_start_loc
            out = self._rule(q, k, v, a, b, rule_state, starts, slots, decode)
            out = _gated_rms_norm(out, z, self.norm.weight, self.eps)
        return self.out_proj(out.reshape(num_tokens, self.value_dim))

    def _starts(self, num_rows: int, device) -> torch.Tensor:
        """[0, 1, ..., num_rows]: a decode step's sequence bounds for the torch and Triton
        paths (the C kernel takes none), views of one tensor (a replayed step reads it)."""
        starts = self._decode_starts.get(str(device))
        if starts is None or starts.numel() <= num_rows:
            rows = max(num_rows, _MAX_DECODE_ROWS)
            starts = torch.arange(rows + 1, dtype=torch.int32, device=device)
            self._decode_starts[str(device)] = starts
        return starts[: num_rows + 1]

    def _rule(self, q, k, v, a, b, state, starts, slots, decode: bool) -> torch.Tensor:
        """The gated delta rule on the GPU's Triton kernels, or in torch."""
        args = (q, k, v, a, b, self.A_log, self.dt_bias, state, starts, slots)
        if envs.MINIVLLM_GPU_LAYER_KERNELS and kernels.triton_layers_for(q) is not None:
            from minivllm.kernels import triton_gated_delta

            return triton_gated_delta.gated_delta_rule(*args, chunked=not decode)
        g, beta = gated_delta_torch.gating(a, b, self.A_log, self.dt_bias)
        return gated_delta_torch.gated_delta_rule(
            q, k, v, g, beta, state, starts, slots, chunk_size=None if decode else _PROMPT_CHUNK
        )


class _GatedNormWeight(nn.Module):
    """The DeltaNet's output norm's weight (``norm.weight``: a plain scale, not an offset)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)


class GatedAttention(nn.Module):
    """Full attention with an output gate per head, per-head zero-centred q/k norms and
    partial RoPE (see the module docstring)."""

    def __init__(
        self, config, backend, quant_config: QuantizationConfig | None, prefix: str
    ) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        # q_proj's rows are [q_h | gate_h] per head: as 2H heads of "q" in the fused product.
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            2 * self.num_heads,
            self.num_kv_heads,
            getattr(config, "attention_bias", False),
            quant_config=quant_config,
            prefix=f"{prefix}.qkv_proj",
        )
        self.o_proj = Linear(
            self.num_heads * self.head_dim,
            config.hidden_size,
            getattr(config, "attention_bias", False),
            quant_config,
            f"{prefix}.o_proj",
        )
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        params = rope_parameters(config)
        rotary = get_rope(self.head_dim, config.max_position_embeddings, params, torch.float32)
        self.attn = Attention(
            self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5, backend, rotary
        )
        self.kernels = gated_delta_cpu.load_kernel()  # the output gate's

    def forward(self, positions, hidden: torch.Tensor, meta) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q_gate, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q_gate = q_gate.view(-1, self.num_heads, 2 * self.head_dim)
        q = self.q_norm(q_gate[..., : self.head_dim])
        gate = q_gate[..., self.head_dim :]
        k = self.k_norm(k.view(-1, self.num_kv_heads, self.head_dim))
        out = self.attn(positions, q, k, v, meta)
        if self.kernels is not None and cpu_kernels.is_cpu_f32(out, gate):
            heads = out.view(-1, self.num_heads, self.head_dim)
            out = gated_delta_cpu.sigmoid_gate(self.kernels, heads, gate).view(out.shape)
        else:
            out = out * torch.sigmoid(gate.reshape(out.shape))
        return self.o_proj(out)


class HybridDecoderLayer(nn.Module):
    """A pre-norm layer whose token mixer is a Gated DeltaNet (``linear_attn``) or a gated
    attention (``self_attn``), as ``layer_types`` says; zero-centred norms."""

    def __init__(self, config, backend, quant_config, layer: int, prefix: str, mlp) -> None:
        super().__init__()
        self.is_linear = config.layer_types[layer] == "linear_attention"
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(config, quant_config, f"{prefix}.linear_attn")
        else:
            self.self_attn = GatedAttention(config, backend, quant_config, f"{prefix}.self_attn")
        self.mlp = mlp
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, hidden, residual, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """As DecoderLayer's (llama.py): (this layer's output, the stream before it)."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        mixer = self.linear_attn if self.is_linear else self.self_attn
        hidden = mixer(positions, hidden, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class HybridMixin:
    """Qwen3-Next's and Qwen3.5's layers on LlamaForCausalLM: put before it."""

    # No CUDA graphs: the Triton decode path has not run on a GPU yet, and the experts
    # route on the host. On the CPU every op of a decode step is a C kernel (the rule, the
    # gated norm, the sigmoid gate, partial RoPE), so the step replays as a CPU graph.
    supports_cuda_graphs = False
    supports_pipeline_parallel = False  # per-request state layers

    packed_modules_mapping = {
        **LlamaForCausalLM.packed_modules_mapping,
        "in_proj_qkv": ("in_proj_qkvz", "qkv"),
        "in_proj_z": ("in_proj_qkvz", "z"),
        "in_proj_b": ("in_proj_ba", "b"),
        "in_proj_a": ("in_proj_ba", "a"),
    }

    def __init__(self, config, backend, tp: TPGroup | None = None, quant_config=None) -> None:
        if tp is not None and tp.size > 1:
            raise ValueError(
                f"{type(self).__name__} runs on one rank: its Gated DeltaNet layers are not "
                "split across tensor-parallel ranks (use tensor_parallel_size=1)"
            )
        super().__init__(config, backend, tp, quant_config)
        self.model.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def make_layer(self, config, backend, tp, quant_config, layer: int, prefix: str):
        mlp = self.make_mlp(config, layer, tp, quant_config, f"{prefix}.mlp")
        mlp = mlp if mlp is not None else MLP(config, tp, quant_config, f"{prefix}.mlp")
        return HybridDecoderLayer(config, backend, quant_config, layer, prefix, mlp)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers if not layer.is_linear]

    def state_layers(self) -> list[StateLayer]:
        return [layer.linear_attn for layer in self.model.layers if layer.is_linear]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(_skip_mtp(weights))


def _skip_mtp(weights):
    """The multi-token-prediction head (``mtp.*``) is not used; Qwen3.5's image-and-text
    checkpoints' vision tower neither."""
    for name, tensor in weights:
        if not name.startswith("mtp.") and ".visual." not in f".{name}":
            yield name, tensor


class Qwen3NextForCausalLM(HybridMixin, QwenMoeMixin, LlamaForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._qwen3_5_layout(weights))

    def _qwen3_5_layout(self, weights) -> Iterator[tuple[str, torch.Tensor]]:
        """in_proj_qkvz and in_proj_ba (per key head) as Qwen3.5's four projections."""
        c = self.config
        hk, dk, dv = c.linear_num_key_heads, c.linear_key_head_dim, c.linear_value_head_dim
        group = c.linear_num_value_heads // hk
        for name, tensor in weights:
            if name.endswith(".in_proj_qkvz.weight"):
                base = name.removesuffix("qkvz.weight")
                per_head = tensor.reshape(hk, -1, tensor.shape[-1])
                q, k, v, z = per_head.split([dk, dk, group * dv, group * dv], dim=1)
                qkv = torch.cat([x.reshape(-1, tensor.shape[-1]) for x in (q, k, v)])
                yield f"{base}qkv.weight", qkv
                yield f"{base}z.weight", z.reshape(-1, tensor.shape[-1])
            elif name.endswith(".in_proj_ba.weight"):
                base = name.removesuffix("ba.weight")
                b, a = tensor.reshape(hk, 2 * group, -1).split([group, group], dim=1)
                yield f"{base}b.weight", b.reshape(-1, tensor.shape[-1])
                yield f"{base}a.weight", a.reshape(-1, tensor.shape[-1])
            else:
                yield name, tensor
