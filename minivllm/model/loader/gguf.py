"""GGUF files: the header, the Hugging Face config and names, the tensors.

A GGUF file holds llama.cpp's names and layouts; everything leaves this module under
Hugging Face's (config fields, parameter names, q/k row order, Gemma's norm weights), so
the model code knows one naming scheme. Tensors come either dequantized (a float tensor in
the asked dtype) or, with ``keep_quantized``, as their blocks with their GGML type
(``GGUFTensor``) for the matrices the GGUF kernels multiply.
"""

from __future__ import annotations

import math
import mmap
import os
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from transformers import PretrainedConfig

if TYPE_CHECKING:
    from minivllm.model.layers.quantization.gguf import GGUFTensor

# GGUF architecture name -> Hugging Face model class named in config.architectures.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "gemma4": "Gemma4ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "granitemoe": "GraniteMoeForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
    "glm4": "Glm4ForCausalLM",
    "ernie4_5": "Ernie4_5ForCausalLM",
}
# Laid out as llama's by llama.cpp's converters (subclasses of its llama one): q and k rows
# permuted for its RoPE.
_LLAMA_LAYOUT = ("llama", "smollm3", "granite", "granitemoe")
# SmolLM3: RoPE in three layers of four, the fourth without (llama.cpp fixes the step).
_SMOLLM3_NO_ROPE_STEP = 4
_GEMMA = ("gemma2", "gemma3")
# Norms after the sublayers, under Gemma's names (OLMo 2 has only those two).
_POST_NORMS = (*_GEMMA, "olmo2")
# gpt-oss: llama.cpp hard-codes its SwiGLU's alpha and limit (HF's config defaults).
_GPT_OSS_SWIGLU = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}
# mixtures of experts: a router and stacked expert matrices a layer
_MOE = ("qwen3moe", "qwen2moe", "olmoe")
# llama files with experts are Mixtral's.
_MIXTRAL = {"architectures": ["MixtralForCausalLM"], "sliding_window": None}


def is_gguf(path: str) -> bool:
    return os.path.isfile(path) and path.endswith(".gguf")


# --------------------------------------------------------------------------- GGUF header

# GGUF value type id -> struct format: (u)int8/16/32, float32, bool, then after 8 (string)
# and 9 (array) come (u)int64 and float64.
_GGUF_SCALAR_FORMATS = dict(zip([0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12], "BbHhIif?Qqd", strict=True))
_GGUF_STRING = 8
_GGUF_ARRAY = 9


@dataclass(frozen=True)
class GGUFHeader:
    """Metadata and tensor shapes of a GGUF file.

    ``metadata`` holds scalars, strings and numeric arrays (as numpy arrays). String arrays
    (the tokenizer vocabulary and merges) are left out: they are large and slow to decode.
    ``tensor_shapes`` is in PyTorch order, i.e. ggml's ``ne`` reversed.
    """

    metadata: dict[str, Any]
    tensor_shapes: dict[str, tuple[int, ...]]
    # name -> (ggml type id, absolute byte offset of its data in the file)
    tensor_data: dict[str, tuple[int, int]] = field(default_factory=dict)


def read_gguf_header(path: str | os.PathLike[str]) -> GGUFHeader:
    """Parse a GGUF file's metadata and tensor table without reading any tensor data.

    gguf.GGUFReader takes about 2 s on SmolLM2 because it builds numpy views for each of
    the ~100k vocabulary strings; this reader skips those and takes a few tens of ms.
    """
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ValueError(f"not a GGUF file: {path}")
        order = "<"
        (version,) = struct.unpack_from("<I", buf, 4)
        if version & 0xFFFF == 0:  # a small version number read with the wrong byte order
            order = ">"
            (version,) = struct.unpack_from(">I", buf, 4)
        if version < 2:
            raise ValueError(f"GGUF version {version} is not supported: {path}")
        n_tensors, n_kv = struct.unpack_from(order + "QQ", buf, 8)
        pos = 24

        def read_string(at: int) -> tuple[str, int]:
            (length,) = struct.unpack_from(order + "Q", buf, at)
            at += 8
            return bytes(buf[at : at + length]).decode("utf-8", errors="replace"), at + length

        def read_value(vtype: int, at: int) -> tuple[Any, int]:
            if vtype == _GGUF_STRING:
                return read_string(at)
            if vtype == _GGUF_ARRAY:
                item_type, count = struct.unpack_from(order + "IQ", buf, at)
                at += 12
                if item_type == _GGUF_STRING:
                    for _ in range(count):  # skip without decoding
                        (length,) = struct.unpack_from(order + "Q", buf, at)
                        at += 8 + length
                    return None, at
                if item_type == _GGUF_ARRAY:
                    raise ValueError(f"nested GGUF arrays are not supported: {path}")
                if item_type not in _GGUF_SCALAR_FORMATS:
                    raise ValueError(f"unknown GGUF array type {item_type}: {path}")
                dtype = np.dtype(order + _GGUF_SCALAR_FORMATS[item_type])
                values = np.frombuffer(buf, dtype=dtype, count=count, offset=at).copy()
                return values, at + count * dtype.itemsize
            if vtype not in _GGUF_SCALAR_FORMATS:
                raise ValueError(f"unknown GGUF value type {vtype}: {path}")
            fmt = order + _GGUF_SCALAR_FORMATS[vtype]
            return struct.unpack_from(fmt, buf, at)[0], at + struct.calcsize(fmt)

        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key, pos = read_string(pos)
            (vtype,) = struct.unpack_from(order + "I", buf, pos)
            value, pos = read_value(vtype, pos + 4)
            if value is not None:
                metadata[key] = value

        shapes: dict[str, tuple[int, ...]] = {}
        relative: dict[str, tuple[int, int]] = {}
        for _ in range(n_tensors):
            name, pos = read_string(pos)
            (n_dims,) = struct.unpack_from(order + "I", buf, pos)
            dims = struct.unpack_from(order + "Q" * n_dims, buf, pos + 4)
            pos += 4 + 8 * n_dims
            relative[name] = struct.unpack_from(order + "IQ", buf, pos)  # type id, offset
            pos += 12
            shapes[name] = tuple(int(d) for d in reversed(dims))
        # Tensor data starts at the next multiple of the alignment after the header.
        alignment = int(metadata.get("general.alignment", 32))
        data_start = -(-pos // alignment) * alignment
        data = {name: (int(t), data_start + int(off)) for name, (t, off) in relative.items()}
    return GGUFHeader(metadata=metadata, tensor_shapes=shapes, tensor_data=data)


def _f32_decimal(value: float) -> float:
    # GGUF stores these as float32: return the shortest decimal that rounds to the same
    # float32, so an epsilon of 1e-5 reads back as 1e-5 and not 9.999999747e-06.
    return float(str(np.float32(value)))


def load_gguf_config(path: str) -> PretrainedConfig:
    """The Hugging Face config of a GGUF file, as transformers' GGUF loading fills it."""
    header = read_gguf_header(path)
    meta, shapes = header.metadata, header.tensor_shapes
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported (supported: "
            f"{', '.join(GGUF_ARCHITECTURES)}): {path}"
        )
    missing = object()

    def get(key: str, default: Any = missing) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is missing:
            raise ValueError(f"GGUF metadata lacks {arch}.{key}: {path}")
        return value

    num_heads = int(get("attention.head_count"))
    num_kv_heads = get("attention.head_count_kv", num_heads)
    if isinstance(num_kv_heads, np.ndarray):  # some files store one count per layer
        # (Gemma 4: its global layers' own, read by _gemma4_config)
        if len(set(num_kv_heads.tolist())) != 1 and arch != "gemma4":
            raise ValueError(f"per-layer KV head counts are not supported: {path}")
        num_kv_heads = num_kv_heads[0]
    feed_forward = get("feed_forward_length")
    if isinstance(feed_forward, np.ndarray):  # per layer (Gemma 4's double-wide MLPs)
        feed_forward = feed_forward[0]
    # key_length is only written when head_dim != hidden/heads; the q rows always tell.
    head_dim = get("attention.key_length", _q_rows(shapes, num_heads, num_kv_heads) // num_heads)

    rope: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": _f32_decimal(get("rope.freq_base", 10000.0)),
    }
    scaling = get("rope.scaling.type", "none")
    if scaling in ("linear", "yarn"):
        rope["rope_type"] = scaling
        rope["factor"] = _f32_decimal(get("rope.scaling.factor"))
        if scaling == "yarn":
            rope["original_max_position_embeddings"] = int(
                get("rope.scaling.original_context_length")
            )
            for beta in ("beta_fast", "beta_slow"):
                value = get(f"rope.scaling.yarn_{beta}", None)
                if value is not None:
                    rope[beta] = _f32_decimal(value)
    elif scaling != "none":
        raise NotImplementedError(f"GGUF rope scaling {scaling!r} is not supported: {path}")

    kwargs: dict[str, Any] = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "vocab_size": int(get("vocab_size", shapes["token_embd.weight"][0])),
        "hidden_size": int(get("embedding_length")),
        "intermediate_size": int(feed_forward),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(num_kv_heads),
        "head_dim": int(head_dim),
        "max_position_embeddings": int(get("context_length")),
        "rms_norm_eps": _f32_decimal(get("attention.layer_norm_rms_epsilon")),
        "rope_parameters": rope,
        # llama.cpp drops output.weight when the head shares the embedding matrix.
        "tie_word_embeddings": "output.weight" not in shapes,
    }
    if arch in (*_LLAMA_LAYOUT, "glm4"):  # qwen2 always has q/k/v biases, qwen3 never
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in shapes
    if arch == "glm4":  # RoPE on part of each head: rope.dimension_count of head_dim
        rope = kwargs["rope_parameters"]
        rope["partial_rotary_factor"] = int(get("rope.dimension_count")) / kwargs["head_dim"]
    if arch in ("granite", "granitemoe"):
        kwargs.update(_granite_config(get, kwargs))
    if arch == "granitemoe" and "blk.0.ffn_gate_shexp.weight" in shapes:
        raise NotImplementedError(f"Granite MoE with a shared expert (GraniteMoeShared): {path}")
    if arch == "olmo2" and get("attention.sliding_window", None) is not None:
        kwargs.update(_olmo3_config(get, kwargs))
    if arch == "smollm3":
        step = _SMOLLM3_NO_ROPE_STEP
        kwargs["no_rope_layer_interval"] = step
        kwargs["no_rope_layers"] = [
            int((i + 1) % step != 0) for i in range(kwargs["num_hidden_layers"])
        ]
    if arch in _GEMMA:
        kwargs.update(_gemma_config(arch, get, kwargs))
    if arch == "gemma4":
        kwargs.update(_gemma4_config(path, header, get, kwargs))
    if arch == "phi3":
        kwargs.update(_phi3_config(path, header, get, kwargs))
    if arch == "gpt-oss":
        kwargs.update(_gpt_oss_config(get, kwargs))
    if arch in _MOE or (arch in ("llama", "granitemoe") and get("expert_count", 0)):
        kwargs.update(_moe_config(arch, get, shapes, kwargs))
    clamp = get("attention.clamp_kqv", None)  # OLMo's clip_qkv
    if clamp is not None:
        kwargs["clip_qkv"] = _f32_decimal(clamp)
    for gguf_key, hf_key in (("bos", "bos"), ("eos", "eos"), ("padding", "pad")):
        token_id = meta.get(f"tokenizer.ggml.{gguf_key}_token_id")
        if token_id is not None:
            kwargs[f"{hf_key}_token_id"] = int(token_id)
    # A plain PretrainedConfig, not AutoConfig.for_model: importing transformers' LlamaConfig
    # pulls in most of transformers (1.5 s here, in the frontend and again in the engine
    # process that unpickles it), and the engine reads only the fields set here.
    config = PretrainedConfig(**kwargs)
    if "rope_freqs.weight" in shapes and arch != "gemma4":
        # Llama 3.x files hold their rope scaling as one divisor per frequency (what HF's
        # llama3 parameters work out to); llama.cpp divides the frequencies by them. Set
        # after the config is made: transformers warns of a key it does not know.
        factors = _f32_values(path, header, "rope_freqs.weight")
        config.rope_parameters["freq_factors"] = [float(v) for v in factors]
    config.model_type = {
        "gemma3": "gemma3_text",
        "gemma4": "gemma4_text",
        "qwen3moe": "qwen3_moe",
        "qwen2moe": "qwen2_moe",
        "gpt-oss": "gpt_oss",
    }.get(arch, arch)
    if config.architectures == ["Olmo3ForCausalLM"]:
        config.model_type = "olmo3"
    if config.architectures == _MIXTRAL["architectures"]:
        config.model_type = "mixtral"
    config._name_or_path = path
    return config


def _gemma4_config(path: str, header: GGUFHeader, get, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Gemma 4's fields, as llama.cpp's converter writes them: key_length is the global
    layers' head size (key_length_swa the others'), head_count_kv one count per layer when
    the global layers have their own; a flag per layer for the windowed ones; the MLPs of
    the layers sharing K/V twice as wide where feed_forward_length says so; values taken
    from the keys where a global layer has no attn_v. The global layers' proportional RoPE
    is a rope_freqs tensor: factor 1 for the pairs that turn, 1e30 (no turn) for the rest."""
    shapes = header.tensor_shapes
    layers = kwargs["num_hidden_layers"]
    layer_types = _layer_types(get, layers, every=6)
    full = [i for i, kind in enumerate(layer_types) if kind == "full_attention"]
    sliding = [i for i, kind in enumerate(layer_types) if kind == "sliding_attention"]
    kv_heads = get("attention.head_count_kv")
    if not isinstance(kv_heads, np.ndarray):
        kv_heads = np.full(layers, kv_heads)
    global_head_dim = kwargs["head_dim"]
    head_dim = int(get("attention.key_length_swa", global_head_dim))
    feed_forward = get("feed_forward_length")
    shared = int(get("attention.shared_kv_layers", 0))
    rope = {"rope_type": "proportional", "rope_theta": kwargs["rope_parameters"]["rope_theta"]}
    if "rope_freqs.weight" in shapes:
        turned = int((_f32_values(path, header, "rope_freqs.weight") == 1.0).sum())
        rope["partial_rotary_factor"] = 2 * turned / global_head_dim
    swa_theta = _f32_decimal(get("rope.freq_base_swa", 10000.0))
    per_layer = int(get("embedding_length_per_layer_input", 0))
    config: dict[str, Any] = {
        "head_dim": head_dim,
        "num_key_value_heads": int(kv_heads[sliding[0]] if sliding else kv_heads[0]),
        # The global layers' own, as HF's config holds them (transformers' per-layer view).
        "per_layer_config": {
            i: {"head_dim": global_head_dim, "num_key_value_heads": int(kv_heads[i])} for i in full
        },
        "attention_k_eq_v": bool(full) and f"blk.{full[0]}.attn_v.weight" not in shapes,
        "layer_types": layer_types,
        "sliding_window": int(get("attention.sliding_window")),
        "num_kv_shared_layers": shared,
        "use_double_wide_mlp": isinstance(feed_forward, np.ndarray)
        and len(set(feed_forward.tolist())) > 1,
        "rope_parameters": {
            "full_attention": rope,
            "sliding_attention": {"rope_type": "default", "rope_theta": swa_theta},
        },
        "hidden_size_per_layer_input": per_layer,
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": get("final_logit_softcapping", None),
    }
    if per_layer:
        config["vocab_size_per_layer_input"] = shapes["per_layer_token_embd.weight"][0]
    if get("expert_count", 0):
        config.update(
            enable_moe_block=True,
            num_experts=int(get("expert_count")),
            top_k_experts=int(get("expert_used_count")),
            moe_intermediate_size=int(get("expert_feed_forward_length")),
        )
    return config


def _granite_config(get, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Granite's four scales under its HF config's names; llama.cpp reads a missing
    attention scale as 1/sqrt(head_dim) and the others as 1."""
    return {
        "embedding_multiplier": _f32_decimal(get("embedding_scale", 1.0)),
        "residual_multiplier": _f32_decimal(get("residual_scale", 1.0)),
        "attention_multiplier": _f32_decimal(
            get("attention.scale", 0.0) or kwargs["head_dim"] ** -0.5
        ),
        "logits_scaling": _f32_decimal(get("logit_scale", 1.0)),
    }


def _gpt_oss_config(get, kwargs: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss's fields under its HF config's names. The file says which layers are windowed
    (a flag per layer, or one layer in n not; by default the even ones, as HF's configs);
    YaRN's ramp is not rounded to whole dimensions (HF's released configs: truncate false;
    llama.cpp rounds)."""
    rope = dict(kwargs["rope_parameters"])
    if rope["rope_type"] == "yarn":
        rope["truncate"] = False
    return {
        **_GPT_OSS_SWIGLU,
        "rope_parameters": rope,
        "intermediate_size": int(get("expert_feed_forward_length")),
        "num_local_experts": int(get("expert_count")),
        "num_experts_per_tok": int(get("expert_used_count")),
        "sliding_window": int(get("attention.sliding_window")),
        "layer_types": _layer_types(get, kwargs["num_hidden_layers"], every=2),
        "attention_bias": True,
    }


def _olmo3_config(get, kwargs: dict[str, Any]) -> dict[str, Any]:
    """OLMo 3, which llama.cpp writes as olmo2 with a window: the windowed layers (three of
    four by default), whose RoPE is plain (base rope.freq_base_swa where given), the file's
    scaling (YaRN) on the full-attention layers only, as llama.cpp and HF's Olmo3 do."""
    theta = _f32_decimal(get("rope.freq_base_swa", kwargs["rope_parameters"]["rope_theta"]))
    return {
        "architectures": ["Olmo3ForCausalLM"],
        "sliding_window": int(get("attention.sliding_window")),
        "layer_types": _layer_types(get, kwargs["num_hidden_layers"], every=4),
        "rope_parameters": {
            "full_attention": kwargs["rope_parameters"],
            "sliding_attention": {"rope_type": "default", "rope_theta": theta},
        },
    }


def _layer_types(get, layers: int, every: int) -> list[str]:
    """Each layer's attention, as llama.cpp reads the file: a windowed flag per layer, or a
    pattern n (every n-th layer full, the others windowed; 0: all windowed), by default
    ``every``."""
    pattern = get("attention.sliding_window_pattern", every)
    if isinstance(pattern, np.ndarray):
        windowed = [bool(flag) for flag in pattern.tolist()]
    else:
        n = int(pattern)
        windowed = [n == 0 or i % n < n - 1 for i in range(layers)]
    return ["sliding_attention" if w else "full_attention" for w in windowed]


def _q_rows(shapes: dict[str, tuple[int, ...]], num_heads: int, num_kv_heads: int) -> int:
    if "blk.0.attn_qkv.weight" in shapes:  # phi3: q, k and v rows in one matrix
        rows = shapes["blk.0.attn_qkv.weight"][0]
        return rows * num_heads // (num_heads + 2 * int(num_kv_heads))
    return shapes["blk.0.attn_q.weight"][0]


def _phi3_config(path: str, header: GGUFHeader, get, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Phi-3's fields, as its HF config holds them.

    llama.cpp's converter writes the trained context (rope.scaling.original_context_length),
    the rotated dimensions (partial rotary), the window (0 for none) and, for LongRoPE
    models (128k, Phi-3.5, Phi-4 mini), the long and short factor lists as tensors with
    their attention factor. llama.cpp itself ignores phi3's window; HF applies it, and so
    does this engine, as it does for the HF checkpoint.
    """
    context = kwargs["max_position_embeddings"]
    original = int(get("rope.scaling.original_context_length", context))
    rope = dict(kwargs["rope_parameters"])
    rope["partial_rotary_factor"] = (
        int(get("rope.dimension_count", kwargs["head_dim"])) / (kwargs["head_dim"])
    )
    if "rope_factors_long.weight" in header.tensor_shapes:
        rope["rope_type"] = "longrope"
        rope["original_max_position_embeddings"] = original
        for kind in ("long", "short"):
            values = _f32_values(path, header, f"rope_factors_{kind}.weight")
            rope[f"{kind}_factor"] = [_f32_decimal(v) for v in values]
        # HF's default from the stretch (max / original); set only where the file differs.
        factor = context / original
        default = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
        attention_factor = get("rope.scaling.attn_factor", None)
        if attention_factor is not None and abs(attention_factor - default) > 1e-6:
            rope["attention_factor"] = _f32_decimal(attention_factor)
    return {
        "rope_parameters": rope,
        "original_max_position_embeddings": original,
        "sliding_window": int(get("attention.sliding_window", 0)) or None,
    }


def _f32_values(path: str, header: GGUFHeader, name: str) -> np.ndarray:
    """A small F32/F16 tensor of the file, as float32 values."""
    type_id, offset = header.tensor_data[name]
    dtypes = {0: np.float32, 1: np.float16}  # GGML F32, F16
    if type_id not in dtypes:
        raise ValueError(f"{name} of GGML type {type_id} is not supported: {path}")
    count = int(np.prod(header.tensor_shapes[name]))
    return np.fromfile(path, dtype=dtypes[type_id], count=count, offset=offset).astype(np.float32)


def _moe_config(
    arch: str, get, shapes: dict[str, tuple[int, ...]], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """The experts' fields, under Qwen2/3-MoE's or Mixtral's names. llama.cpp's qwen3moe
    renormalises the chosen experts' weights (HF's norm_topk_prob, which real Qwen3-MoE
    configs set) unless the file says otherwise, its qwen2moe does not; a layer without a
    router is a dense one. Qwen2-MoE adds a shared expert. Mixtral's and OLMoE's experts
    are feed_forward_length wide (their configs' intermediate_size); Mixtral's files hold
    no window."""
    experts = {
        "num_local_experts": int(get("expert_count")),
        "num_experts_per_tok": int(get("expert_used_count")),
    }
    if arch == "llama":
        return {**_MIXTRAL, **experts}
    if arch == "granitemoe":  # Mixtral's names; experts feed_forward_length wide
        return experts
    layers = range(kwargs["num_hidden_layers"])
    dense = [i for i in layers if f"blk.{i}.ffn_gate_inp.weight" not in shapes]
    first_sparse = next(i for i in layers if i not in dense)
    shared = {}
    if arch == "qwen2moe":
        rows = shapes[f"blk.{first_sparse}.ffn_gate_shexp.weight"][0]
        shared = {
            "shared_expert_intermediate_size": int(get("expert_shared_feed_forward_length", rows))
        }
    return {
        **shared,
        "num_experts": int(get("expert_count")),
        "num_experts_per_tok": int(get("expert_used_count")),
        "moe_intermediate_size": int(
            get("expert_feed_forward_length", shapes[f"blk.{first_sparse}.ffn_gate_exps.weight"][1])
        ),
        "norm_topk_prob": bool(get("expert_weights_norm", arch == "qwen3moe")),
        "decoder_sparse_step": 1,
        "mlp_only_layers": dense,
    }


def _gemma_config(arch: str, get, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2's or 3's fields, as transformers' GGUF loading fills their configs.

    The file names the (global) RoPE base, the window and the soft caps; the rest are the
    models' defaults: every sixth layer global in Gemma 3 (whose local layers rotate with
    base 10,000), every second in Gemma 2; tanh-GELU. llama.cpp scales queries by
    1/sqrt(head_dim), except for the 27B models (Gemma 2: 46 layers, Gemma 3: 62):
    1/sqrt(hidden / heads).
    """
    rope = kwargs["rope_parameters"]
    layers = kwargs["num_hidden_layers"]
    scalar = kwargs["head_dim"]
    if layers == (46 if arch == "gemma2" else 62):
        scalar = kwargs["hidden_size"] // kwargs["num_attention_heads"]
    pattern = 2 if arch == "gemma2" else 6
    if arch == "gemma3":
        rope = {
            "full_attention": rope,  # rope scaling, if any, applies to global layers only
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        }
    return {
        "rope_parameters": rope,
        "sliding_window": int(get("attention.sliding_window")),
        "layer_types": [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(layers)
        ],
        "query_pre_attn_scalar": scalar,
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": get("final_logit_softcapping", None),
        "attn_logit_softcapping": get("attn_logit_softcapping", None),
    }


# --------------------------------------------------------------------------- weights

# llama.cpp tensor name (without "blk.N." and suffix) -> Hugging Face module name.
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # Mixtures of experts: the router, and every expert's matrix stacked in one tensor
    # [experts, rows, columns], which _tensors yields expert by expert (experts.{e}.*).
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    # Qwen2-MoE's shared expert and its gate (a vector: HF's [1, hidden] Linear).
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# Gemma 2 and 3 have four norms per layer: ffn_norm is the one before the MLP there.
_GGUF_GEMMA_LAYER_NAMES = {
    **_GGUF_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# gpt-oss: the norm before the MLP is named as Gemma's after attention; a router with a
# bias; each head's attention sink (a vector, named without .weight in HF).
_GGUF_GPT_OSS_LAYER_NAMES = {
    **_GGUF_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_gate_inp": "mlp.router",
    "attn_sinks": "self_attn.sinks",
}
# GLM-4: a norm on each side of both sublayers (Gemma's four under GLM's names), gate/up
# in the one named ffn_up.
_GGUF_GLM4_LAYER_NAMES = {
    **_GGUF_LAYER_NAMES,
    "post_attention_norm": "post_self_attn_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_mlp_layernorm",
    "ffn_up": "mlp.gate_up_proj",
}
# Gemma 4: Gemma's four norms a layer (no 1 added); beside the MLP of a 26B-A4B layer, the
# router (its scale vectors named as llama.cpp's) and the experts (gate/up fused or apart),
# with a norm for each branch; the per-layer embeddings' gate, projection and norm; the
# layer's output scale.
_GGUF_GEMMA4_LAYER_NAMES = {
    **_GGUF_GEMMA_LAYER_NAMES,
    "ffn_gate_inp": "router.proj",
    "ffn_gate_inp.scale": "router.scale",
    "ffn_down_exps.scale": "router.per_expert_scale",
    "ffn_gate_up_exps": "experts.gate_up_proj",
    "ffn_gate_exps": "experts.gate_proj",
    "ffn_up_exps": "experts.up_proj",
    "ffn_down_exps": "experts.down_proj",
    "pre_ffw_norm_2": "pre_feedforward_layernorm_2",
    "post_ffw_norm_1": "post_feedforward_layernorm_1",
    "post_ffw_norm_2": "post_feedforward_layernorm_2",
    "inp_gate": "per_layer_input_gate",
    "proj": "per_layer_projection",
    "post_norm": "post_per_layer_input_norm",
    "layer_output_scale.weight": "layer_scalar",
}
# Phi-3 keeps q/k/v in one matrix, and gate/up in the one named ffn_up.
_GGUF_PHI3_LAYER_NAMES = {
    **_GGUF_LAYER_NAMES,
    "attn_qkv": "self_attn.qkv_proj",
    "ffn_up": "mlp.gate_up_proj",
}
_GGUF_ARCH_LAYER_NAMES = {
    "phi3": _GGUF_PHI3_LAYER_NAMES,
    "gpt-oss": _GGUF_GPT_OSS_LAYER_NAMES,
    "glm4": _GGUF_GLM4_LAYER_NAMES,
    "gemma4": _GGUF_GEMMA4_LAYER_NAMES,
}
# Tensors read into the config, not the model: phi3's LongRoPE factors.
_GGUF_CONFIG_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
_GGUF_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    # Gemma 4's per-layer embeddings
    "per_layer_token_embd": "model.embed_tokens_per_layer",
    "per_layer_model_proj": "model.per_layer_model_projection",
    "per_layer_proj_norm": "model.per_layer_projection_norm",
}
_GGUF_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias|scale)")
_GGUF_GLOBAL_RE = re.compile(r"(\w+)\.(weight|bias)")
# Mixtral files from before llama.cpp stacked the experts hold each one's matrices apart.
_GGUF_EXPERT_RE = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight")


def hf_name(gguf_name: str, arch: str = "llama") -> str:
    """The Hugging Face parameter name of a llama.cpp tensor name."""
    layer_names = _GGUF_GEMMA_LAYER_NAMES if arch in _POST_NORMS else _GGUF_LAYER_NAMES
    layer_names = _GGUF_ARCH_LAYER_NAMES.get(arch, layer_names)
    match = _GGUF_LAYER_RE.fullmatch(gguf_name)
    if match and f"{match.group(2)}.{match.group(3)}" in layer_names:  # the whole name
        layer, module, kind = match.groups()
        return f"model.layers.{layer}.{layer_names[f'{module}.{kind}']}"
    if match and match.group(2) in layer_names and match.group(3) != "scale":
        layer, module, kind = match.groups()
        if module == "attn_sinks":
            return f"model.layers.{layer}.{layer_names[module]}"
        return f"model.layers.{layer}.{layer_names[module]}.{kind}"
    match = _GGUF_GLOBAL_RE.fullmatch(gguf_name)
    if match and match.group(1) in _GGUF_GLOBAL_NAMES:
        return f"{_GGUF_GLOBAL_NAMES[match.group(1)]}.{match.group(2)}"
    match = _GGUF_EXPERT_RE.fullmatch(gguf_name)
    if match:
        layer, proj, expert = match.groups()
        return f"model.layers.{layer}.mlp.experts.{expert}.{proj}_proj.weight"
    raise ValueError(f"unknown GGUF tensor {gguf_name!r}")


def _unpermute_rotary(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    # llama.cpp's converter reorders each head's rows from HF's "first half / second half"
    # rotary layout to interleaved pairs (row i of half 0 next to row i of half 1).
    # Reading the rows as (pair, half) and swapping the two axes restores HF's order.
    rows = weight.shape[0]
    pairs = rows // num_heads // 2
    grouped = weight.reshape(num_heads, pairs, 2, *weight.shape[1:])
    return grouped.transpose(1, 2).reshape(weight.shape)


def iter_gguf_weights(
    path: str,
    dtype: torch.dtype,
    keep_quantized: bool = False,
    device: torch.device | str | None = None,
) -> Iterator[tuple[str, torch.Tensor | GGUFTensor]]:
    """The file's ``(Hugging Face name, tensor)`` pairs, in the file's order.

    A tensor comes dequantized to float32, then cast to dtype, on ``device`` (default: the
    CPU): its blocks are copied there as stored, one tensor at a time, and dequantized
    there (gguf_dequant.py), the q/k row order and Gemma's norms restored there too. The
    few types without a torch dequantizer (IQ lattice types) are dequantized on the host
    by gguf's numpy code and copied as float32. With keep_quantized, a
    matrix in a GGML type the GGUF kernels take comes as a ``GGUFTensor`` (its blocks, read
    into memory of its own) instead. Not a view of the file's map: the layers repack most
    blocks after loading, and a view would keep the whole map alive, with every page the
    repacking read counted in the process's RSS beside the packed copy (twice the file).
    """
    # Our own header reader and a memory map: GGUFReader would spend seconds on the vocab.
    header = read_gguf_header(path)
    meta = header.metadata
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported: {path}")
    num_heads = int(meta[f"{arch}.attention.head_count"])
    num_kv_heads = np.ravel(meta.get(f"{arch}.attention.head_count_kv", num_heads))[0]
    # Only llama.cpp's llama converter (and SmolLM3's, its subclass) permutes q/k;
    # qwen2/qwen3 keep HF's layout.
    permuted_heads = {".self_attn.q_proj.": num_heads, ".self_attn.k_proj.": num_kv_heads}
    if arch not in _LLAMA_LAYOUT:
        permuted_heads = {}
    # Copy-on-write: writable arrays for torch.from_numpy, and the file is never written.
    data = np.memmap(path, dtype=np.uint8, mode="c")
    with open(path, "rb") as file:  # the quantized blocks are read, not mapped
        yield from _tensors(header, data, file, keep_quantized, arch, permuted_heads, dtype, device)


def _tensors(
    header: GGUFHeader,
    data: np.ndarray,
    file: Any,
    keep_quantized: bool,
    arch: str,
    permuted_heads: dict[str, int],
    dtype: torch.dtype,
    device: torch.device | str | None,
) -> Iterator[tuple[str, torch.Tensor | GGUFTensor]]:
    # Imported here so that reading configs and tokenizers does not pay for it.
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    from minivllm.kernels import gguf_kernels

    for gguf_name, shape in header.tensor_shapes.items():
        if gguf_name == "rope_freqs.weight":  # read into the config's rope parameters
            continue
        if gguf_name in _GGUF_CONFIG_TENSORS:
            continue
        name = hf_name(gguf_name, arch)
        type_id, offset = header.tensor_data[gguf_name]
        qtype = GGMLQuantizationType(type_id)
        block, type_size = GGML_QUANT_SIZES[qtype]
        rows = int(np.prod(shape[:-1], dtype=np.int64))
        nbytes = rows * (shape[-1] // block * type_size)
        heads = next((n for part, n in permuted_heads.items() if part in name), None)
        # Every expert's matrix [E, rows, columns], or (gpt-oss) bias [E, rows], in one tensor.
        bias = name.endswith(".bias")
        stacked = len(shape) == (2 if bias else 3) and ".experts." in name
        matrix = not bias and (len(shape) == 2 or stacked)
        if keep_quantized and matrix and type_id in gguf_kernels.BLOCK_SIZES:
            blocks = gguf_kernels.anonymous_bytes(nbytes)  # freed to the system once repacked
            file.seek(offset)
            if file.readinto(blocks.numpy()) != nbytes:
                raise ValueError(f"GGUF file ends inside tensor {gguf_name}")
            tensor = _raw_blocks(blocks, type_id, (rows, shape[-1]), heads)
            if stacked:  # expert e's matrix: whole rows, so whole blocks
                per = shape[1]
                yield from _experts(
                    name, [tensor.narrow_rows(e * per, per) for e in range(shape[0])]
                )
                continue
            yield name, tensor
            continue
        raw = data[offset : offset + nbytes]
        weight = _dequantized(raw, qtype, shape, heads, device)
        if stacked:
            yield from _experts(name, weight.to(dtype).unbind(0))
            continue
        if name.endswith(".shared_expert_gate.weight"):
            weight = weight.reshape(1, -1)
        if arch in _GEMMA and name.endswith("norm.weight"):
            # llama.cpp stores Gemma's (1 + w) norm weights with the 1 added; HF's are w.
            weight = weight - 1
        yield name, weight.to(dtype)


def _experts(name: str, matrices) -> Iterator[tuple[str, Any]]:
    """A stacked tensor's matrices under each expert's name: mlp.experts.gate_proj.weight
    -> mlp.experts.0.gate_proj.weight, ...; a fused gate_up_proj (Gemma 4's: gate rows,
    then up rows) as each expert's gate_proj and up_proj."""
    experts, proj, kind = name.rsplit(".", 2)
    for e, matrix in enumerate(matrices):
        if proj != "gate_up_proj":
            yield f"{experts}.{e}.{proj}.{kind}", matrix
            continue
        half = matrix.shape[0] // 2  # GGUFTensor.narrow(0, ...) takes whole rows too
        yield f"{experts}.{e}.gate_proj.{kind}", matrix.narrow(0, 0, half)
        yield f"{experts}.{e}.up_proj.{kind}", matrix.narrow(0, half, half)


def _raw_blocks(
    raw: torch.Tensor, type_id: int, shape: tuple[int, int], heads: int | None
) -> GGUFTensor:
    """A matrix's blocks as stored; rows are whole blocks, so the q/k row order is restored
    on the bytes."""
    from minivllm.kernels import gguf_kernels
    from minivllm.model.layers.quantization.gguf import GGUFTensor

    blocks = raw.view(shape[0], -1)
    if heads is not None:  # as _unpermute_rotary, into a map of its own as the others
        pairs = shape[0] // heads // 2
        out = gguf_kernels.anonymous_bytes(blocks.numel()).view(heads, 2, pairs, -1)
        out.copy_(blocks.view(heads, pairs, 2, -1).transpose(1, 2))
        blocks = out.view(shape[0], -1)
    return GGUFTensor(blocks, type_id, shape)


def _dequantized(
    raw: np.ndarray,
    qtype: Any,
    shape: tuple[int, ...],
    heads: int | None,
    device: torch.device | str | None,
) -> torch.Tensor:
    """A tensor as float32 in HF's layout on device (F32 on the CPU: a view of the map)."""
    from minivllm.model.loader import gguf_dequant

    blocks = torch.from_numpy(raw)
    if gguf_dequant.supports(qtype.value):
        weight = gguf_dequant.dequantize(blocks.to(device=device), qtype.value)
    else:
        from gguf.quants import dequantize

        rows = int(np.prod(shape[:-1], dtype=np.int64))
        weight = torch.from_numpy(dequantize(raw.reshape(rows, -1), qtype)).to(device=device)
    weight = weight.reshape(shape)
    return weight if heads is None else _unpermute_rotary(weight, heads)
