"""Rotary position embedding (rotate-half layout) and the RoPE scaling variants of HF configs.

The inverse frequencies follow transformers' ``modeling_rope_utils`` operation for operation
(same dtypes, same order), so the cos/sin tables equal HF's bit for bit:

- ``default``: ``1 / base ** (2i / d)``;
- ``linear``: the default frequencies divided by ``factor``;
- ``llama3``: low frequencies divided by ``factor``, high ones kept, a smooth blend between;
- ``yarn``: a ramp between interpolated and extrapolated frequencies, cos/sin multiplied by
  an attention factor;
- ``freq_factors`` (a key beside ``default``): the default frequencies divided by one
  factor per frequency, as a GGUF file's ``rope_freqs`` tensor holds Llama 3's scaling;
- ``longrope`` (Phi-3 128k, Phi-3.5, Phi-4 mini): see ``_longrope_tables``;
- ``proportional`` (Gemma 4's global layers): the default frequencies of the first
  ``partial_rotary_factor`` of each head's pairs, with exponents over the whole head, and 0
  (no turn) for the rest: a table as wide as the head;
- ``dynamic`` (NTK): HF recomputes the base from the longest position of each forward pass.
  In greedy generation that is position p + 1 for the token at p, which is what the table
  holds here, whatever the chunking; HF differs only on prompts longer than
  ``max_position_embeddings``, whose tokens all use the prompt's length.

``partial_rotary_factor`` (Phi-4 mini) turns only the first part of each head (in torch: the
C kernel turns whole heads, so such decode steps are not replayed as CPU graphs).

One ``RotaryEmbedding`` per distinct parameter set is shared by every layer (``get_rope``):
a table per layer would cost gigabytes for 128k-position models.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from minivllm import envs, kernels
from minivllm.kernels import cpu_kernels

SUPPORTED_ROPE_TYPES = (
    "default", "linear", "dynamic", "yarn", "llama3", "longrope", "proportional"
)  # fmt: skip


def rope_parameters(config, layer_type: str | None = None) -> dict[str, Any]:
    """The RoPE parameters of a HF config (of one layer type when they are nested by type).

    Reads transformers 5's ``rope_parameters`` and the older ``rope_scaling`` + ``rope_theta``.
    """
    params = getattr(config, "rope_parameters", None)
    if params and layer_type is not None and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    params = dict(params or getattr(config, "rope_scaling", None) or {})
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    if params["rope_type"] in ("llama3", "yarn", "longrope"):
        original = getattr(config, "original_max_position_embeddings", None)
        params.setdefault("original_max_position_embeddings", original)
        if params["original_max_position_embeddings"] is None:
            params["original_max_position_embeddings"] = config.max_position_embeddings
    return params


def max_positions(config) -> int:
    """How many positions a model takes, as vLLM derives it from the RoPE scaling."""
    base = getattr(config, "max_position_embeddings", None) or 2048
    if not (getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)):
        return base
    return _scaled_positions(rope_parameters(config), base)


def _scaled_positions(params: dict[str, Any], max_position: int) -> int:
    # linear, dynamic and yarn stretch the trained context by factor; llama3 configs already
    # name the stretched length in max_position_embeddings.
    rope_type = params.get("rope_type", "default")
    if rope_type in ("linear", "dynamic"):
        return int(max_position * params["factor"])
    if rope_type == "yarn":
        stretched = int(params["original_max_position_embeddings"] * params["factor"])
        return max(max_position, stretched)
    return max_position


def _exponents(dim: int) -> torch.Tensor:
    return torch.arange(0, dim, 2, dtype=torch.int64).float() / dim


def _default_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** _exponents(dim))


def _proportional_inv_freq(params: dict[str, Any], dim: int) -> torch.Tensor:
    turned = int(params.get("partial_rotary_factor", 1.0) * dim // 2)
    exponents = torch.arange(0, 2 * turned, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (params["rope_theta"] ** exponents)
    inv_freq = torch.cat([inv_freq, torch.zeros(dim // 2 - turned)])
    return inv_freq / params.get("factor", 1.0)


def _llama3_inv_freq(params: dict[str, Any], dim: int) -> torch.Tensor:
    inv_freq = _default_inv_freq(params["rope_theta"], dim)
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are divided by factor, short ones kept, those between blended.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(params: dict[str, Any], dim: int) -> tuple[torch.Tensor, float]:
    base = params["rope_theta"]
    factor = params["factor"]
    original = params["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = (
            float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else (mscale(factor))
        )
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        # The dimension whose wavelength turns `rotations` times over the trained context.
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1 for high frequencies (extrapolated), 0 for low ones (interpolated)
    return interpolation * (1 - keep) + extrapolation * keep, attention_factor


def _dynamic_inv_freq(
    params: dict[str, Any], dim: int, max_position: int, seq_len: int
) -> torch.Tensor:
    # HF computes the new base in float32 from a tensor seq_len (max of the position ids + 1).
    factor = params["factor"]
    seq = torch.tensor(max(seq_len, max_position), dtype=torch.float32)
    base = params["rope_theta"] * ((factor * seq / max_position) - (factor - 1)) ** (
        dim / (dim - 2)
    )
    return 1.0 / (base ** _exponents(dim))


def _longrope_tables(
    params: dict[str, Any], dim: int, max_position: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """LongRoPE: the frequencies divided by one factor each, cos/sin times an attention factor.

    HF takes the short factors while the longest position of a forward pass is inside the
    trained context (original_max_position_embeddings), the long ones past it: the table
    holds the short factors up to the trained context and the long ones after it, so a
    sequence that stays inside the trained context (most chats: 4096 tokens for Phi-3.5 and
    Phi-4 mini) gets HF's tokens whatever the chunking. Past it HF differs: its generate()
    drops the cache when a sequence first outgrows the trained context and recomputes every
    key with the long factors (a prompt longer than it uses them throughout), where this
    cache keeps the first keys as they were rotated. vLLM instead takes one set per engine,
    the long one when max_model_len exceeds the trained context.
    """
    original = params["original_max_position_embeddings"]
    # Phi-3 configs name no factor: HF takes the stretch of the context.
    factor = params.get("factor") or max_position / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
        )
    powers = params["rope_theta"] ** _exponents(dim)
    short, long = (
        1.0 / (torch.tensor(params[key], dtype=torch.float32) * powers)
        for key in ("short_factor", "long_factor")
    )
    if short.shape[0] != dim // 2 or long.shape[0] != dim // 2:
        raise ValueError(f"LongRoPE needs {dim // 2} short and long factors for head_dim {dim}")
    positions = torch.arange(max_position)
    emb = torch.cat([_table(short, positions[:original]), _table(long, positions[original:])])
    return emb.cos() * attention_factor, emb.sin() * attention_factor


def _table(inv_freq: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    freqs = positions.float()[:, None] * inv_freq[None, :]
    return torch.cat((freqs, freqs), dim=-1)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position the model takes, and their application to q and k.

    max_position is the config's max_position_embeddings; scaled RoPE stretches it.
    """

    def __init__(
        self, head_dim: int, max_position: int, params: dict[str, Any], dtype: torch.dtype
    ) -> None:
        super().__init__()
        rope_type = params.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"RoPE type {rope_type!r} is not supported (supported: "
                f"{', '.join(SUPPORTED_ROPE_TYPES)})."
            )
        self.head_dim = head_dim
        # Partial rotary (Phi-4 mini: 0.75): the first rotary_dim of each head turn (their
        # halves paired, HF's layout), the rest pass through.
        # Proportional RoPE applies its factor in the frequencies instead.
        partial = 1.0 if rope_type == "proportional" else params.get("partial_rotary_factor", 1.0)
        self.rotary_dim = int(head_dim * partial)
        if self.rotary_dim <= 0 or self.rotary_dim % 2 or self.rotary_dim > head_dim:
            raise ValueError(f"cannot rotate {self.rotary_dim} of {head_dim} head dimensions")
        # The tables are computed on the CPU in float32 (the same numbers on every device),
        # then moved to the device the model is built on.
        device = torch.get_default_device()
        with torch.device("cpu"):
            cos, sin = self._tables(params, rope_type, self.rotary_dim, max_position)
        self.register_buffer("cos", cos.to(device, dtype), persistent=False)
        self.register_buffer("sin", sin.to(device, dtype), persistent=False)
        self.kernels = cpu_kernels.load_kernels("MINIVLLM_CPU_LAYER_KERNELS")
        self.gpu_kernels = envs.MINIVLLM_GPU_LAYER_KERNELS

    @staticmethod
    def _tables(
        params: dict, rope_type: str, head_dim: int, max_position: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [positions, head_dim] in float32, scaling applied (head_dim: the
        rotated dimensions)."""
        if rope_type == "longrope":
            return _longrope_tables(params, head_dim, max_position)
        num_positions = _scaled_positions(params, max_position)
        scaling = 1.0
        if rope_type == "default":
            inv_freq = _default_inv_freq(params["rope_theta"], head_dim)
            factors = params.get("freq_factors")
            if factors is not None:
                if len(factors) != head_dim // 2:
                    raise ValueError(
                        f"{len(factors)} RoPE frequency factors for head_dim {head_dim}"
                    )
                inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float32)
        elif rope_type == "linear":
            inv_freq = _default_inv_freq(params["rope_theta"], head_dim) / params["factor"]
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(params, head_dim)
        elif rope_type == "yarn":
            inv_freq, scaling = _yarn_inv_freq(params, head_dim)
        elif rope_type == "proportional":
            inv_freq = _proportional_inv_freq(params, head_dim)
        else:  # dynamic
            inv_freq = _dynamic_inv_freq(params, head_dim, max_position, max_position)
        table_end = max_position if rope_type == "dynamic" else num_positions
        emb = _table(inv_freq, torch.arange(table_end))
        if num_positions > table_end:
            # Dynamic NTK: the token at position p uses the base for a sequence of p + 1.
            rows = [
                _table(_dynamic_inv_freq(params, head_dim, max_position, p + 1), torch.tensor([p]))
                for p in range(max_position, num_positions)
            ]
            emb = torch.cat([emb, *rows])
        return emb.cos() * scaling, emb.sin() * scaling

    @property
    def num_positions(self) -> int:
        return self.cos.shape[0]

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, H, D], k: [T, Hkv, D]; returns them rotated. On float32 CPU tensors whose
        heads are contiguous (rows may be strided views of the fused qkv) one C call rotates
        them in place, bit for bit as the torch path (partial rotary too); on CUDA tensors
        one Triton kernel."""
        if (
            self.kernels is not None
            and cpu_kernels.is_cpu_f32(q, k, self.cos)
            and positions.dtype == torch.int64
            and q.stride(2) == k.stride(2) == 1
            and q.stride(1) == k.stride(1) == self.head_dim
        ):
            cpu_kernels.rotary_embedding(self.kernels, positions, q, k, self.cos, self.sin)
            return q, k
        if (
            self.gpu_kernels
            and (gpu := kernels.triton_layers_for(q)) is not None
            and q.stride(2) == k.stride(2) == 1
            and self.rotary_dim == self.head_dim
        ):
            gpu.rotary_embedding(positions, q, k, self.cos, self.sin)
            return q, k
        # HF's order: the tables (float32) are cast to q's dtype, the rotation runs in it.
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        if self.rotary_dim == self.head_dim:
            return _rotate(q, cos, sin), _rotate(k, cos, sin)
        dim = self.rotary_dim
        return tuple(
            torch.cat((_rotate(x[..., :dim], cos, sin), x[..., dim:]), dim=-1) for x in (q, k)
        )


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


_ROPE_CACHE: dict[tuple, RotaryEmbedding] = {}


def get_rope(
    head_dim: int,
    max_position: int,
    params: dict[str, Any],
    dtype: torch.dtype = torch.float32,
) -> RotaryEmbedding:
    """The shared RotaryEmbedding for these parameters (built once per process)."""
    key = (head_dim, max_position, repr(sorted(params.items())), dtype)
    rope = _ROPE_CACHE.get(key)
    if rope is None:
        rope = _ROPE_CACHE[key] = RotaryEmbedding(head_dim, max_position, params, dtype)
    return rope
