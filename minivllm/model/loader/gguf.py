"""GGUF files: the header, the Hugging Face config and names, the tensors.

A GGUF file holds llama.cpp's names and layouts; everything leaves this module under
Hugging Face's (config fields, parameter names, q/k row order, Gemma's norm weights), so
the model code knows one naming scheme. Tensors come either dequantized (a float tensor in
the asked dtype) or, with ``keep_quantized``, as their blocks with their GGML type
(``GGUFTensor``) for the matrices the GGUF kernels multiply. A split file is one model,
named by its first part (``NAME-00001-of-0000N.gguf``; gguf_header.py reads the parts).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from transformers import PretrainedConfig

from minivllm.model.loader.gguf_arch import ARCHITECTURES, LAYER_NAMES, GGUFArch, GGUFMeta
from minivllm.model.loader.gguf_arch.base import f32_decimal
from minivllm.model.loader.gguf_header import GGUFHeader, read_gguf_header

if TYPE_CHECKING:
    from minivllm.model.layers.quantization.gguf import GGUFTensor

__all__ = ["GGUFHeader", "hf_name", "is_gguf", "iter_gguf_weights", "load_gguf_config"]
__all__ += ["read_gguf_header"]


def is_gguf(path: str) -> bool:
    return os.path.isfile(path) and path.endswith(".gguf")


def load_gguf_config(path: str) -> PretrainedConfig:
    """The Hugging Face config of a GGUF file, as transformers' GGUF loading fills it."""
    header = read_gguf_header(path)
    meta = GGUFMeta(path, header)
    arch = _architecture(meta.arch, path)
    shapes, get = header.tensor_shapes, meta.get
    num_heads = int(get("attention.head_count"))
    num_kv_heads = get("attention.head_count_kv", num_heads)
    if isinstance(num_kv_heads, np.ndarray):  # some files store one count per layer
        # (Gemma 4: its global layers' own; hybrids: 0 for a layer without attention; read
        # by their config fields)
        if len(set(num_kv_heads.tolist())) != 1 and not arch.per_layer_kv_heads:
            raise ValueError(f"per-layer KV head counts are not supported: {path}")
        num_kv_heads = num_kv_heads[0]
    # A mixture of experts with no dense MLP may lack it (llama.cpp's converter writes it
    # only from an intermediate_size, which Qwen3.5-MoE's config has not).
    feed_forward = get("feed_forward_length", get("expert_feed_forward_length", None))
    if feed_forward is None:
        raise ValueError(f"GGUF metadata lacks {meta.arch}.feed_forward_length: {path}")
    if isinstance(feed_forward, np.ndarray):  # per layer (Gemma 4's double-wide MLPs)
        feed_forward = feed_forward[0]
    # key_length is only written when head_dim != hidden/heads; the q rows always tell.
    head_dim = get("attention.key_length", _q_rows(shapes, num_heads, num_kv_heads) // num_heads)

    rope: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": f32_decimal(get("rope.freq_base", 10000.0)),
    }
    scaling = get("rope.scaling.type", "none")
    if scaling in ("linear", "yarn"):
        rope["rope_type"] = scaling
        rope["factor"] = f32_decimal(get("rope.scaling.factor"))
        if scaling == "yarn":
            rope["original_max_position_embeddings"] = int(
                get("rope.scaling.original_context_length")
            )
            for beta in ("beta_fast", "beta_slow"):
                value = get(f"rope.scaling.yarn_{beta}", None)
                if value is not None:
                    rope[beta] = f32_decimal(value)
    elif scaling != "none":
        raise NotImplementedError(f"GGUF rope scaling {scaling!r} is not supported: {path}")

    kwargs: dict[str, Any] = {
        "architectures": [arch.hf_architecture],
        "vocab_size": int(get("vocab_size", shapes["token_embd.weight"][0])),
        "hidden_size": int(get("embedding_length")),
        "intermediate_size": int(feed_forward),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(num_kv_heads),
        "head_dim": int(head_dim),
        "max_position_embeddings": int(get("context_length")),
        "rms_norm_eps": f32_decimal(get("attention.layer_norm_rms_epsilon")),
        "rope_parameters": rope,
        # llama.cpp drops output.weight when the head shares the embedding matrix.
        "tie_word_embeddings": "output.weight" not in shapes,
    }
    if arch.attention_bias_in_file:  # qwen2 always has q/k/v biases, qwen3 never
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in shapes
    if arch.config is not None:
        kwargs.update(arch.config(meta, kwargs))
    model_type = kwargs.pop("model_type", arch.hf_model_type)
    clamp = get("attention.clamp_kqv", None)  # OLMo's clip_qkv
    if clamp is not None:
        kwargs["clip_qkv"] = f32_decimal(clamp)
    for gguf_key, hf_key in (("bos", "bos"), ("eos", "eos"), ("padding", "pad")):
        token_id = header.metadata.get(f"tokenizer.ggml.{gguf_key}_token_id")
        if token_id is not None:
            kwargs[f"{hf_key}_token_id"] = int(token_id)
    # A plain PretrainedConfig, not AutoConfig.for_model: importing transformers' LlamaConfig
    # pulls in most of transformers (1.5 s here, in the frontend and again in the engine
    # process that unpickles it), and the engine reads only the fields set here.
    config = PretrainedConfig(**kwargs)
    if "rope_freqs.weight" in shapes and arch.rope_freqs_divide:
        # Llama 3.x files hold their rope scaling as one divisor per frequency (what HF's
        # llama3 parameters work out to); llama.cpp divides the frequencies by them. Set
        # after the config is made: transformers warns of a key it does not know.
        factors = meta.f32_values("rope_freqs.weight")
        config.rope_parameters["freq_factors"] = [float(v) for v in factors]
    config.model_type = model_type
    config._name_or_path = path
    return config


def _architecture(name: str | None, path: str) -> GGUFArch:
    if name not in ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {name!r} is not supported (supported: "
            f"{', '.join(ARCHITECTURES)}): {path}"
        )
    return ARCHITECTURES[name]


def _q_rows(shapes: dict[str, tuple[int, ...]], num_heads: int, num_kv_heads: int) -> int:
    if "blk.0.attn_qkv.weight" in shapes:  # phi3: q, k and v rows in one matrix
        rows = shapes["blk.0.attn_qkv.weight"][0]
        return rows * num_heads // (num_heads + 2 * int(num_kv_heads))
    # The first layer with attention (a hybrid model's first layers may have none).
    return next(shape for name, shape in shapes.items() if name.endswith(".attn_q.weight"))[0]


# --------------------------------------------------------------------------- weights

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
    "token_embd_norm": "model.embedding_norm",  # LFM2's final norm
}
# (A module's name may have dots: LFM2's shortconv.conv.)
_GGUF_LAYER_RE = re.compile(r"blk\.(\d+)\.([\w.]+?)\.(weight|bias|scale)")
_GGUF_BARE_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)")
_GGUF_GLOBAL_RE = re.compile(r"(\w+)\.(weight|bias)")
# Mixtral files from before llama.cpp stacked the experts hold each one's matrices apart.
_GGUF_EXPERT_RE = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight")


def hf_name(gguf_name: str, arch: str = "llama") -> str:
    """The Hugging Face parameter name of a llama.cpp tensor name."""
    spec = ARCHITECTURES.get(arch)
    layer_names = spec.layer_names if spec is not None else LAYER_NAMES
    match = _GGUF_LAYER_RE.fullmatch(gguf_name)
    if match and f"{match.group(2)}.{match.group(3)}" in layer_names:  # the whole name
        layer, module, kind = match.groups()
        return f"model.layers.{layer}.{layer_names[f'{module}.{kind}']}"
    if match and match.group(2) in layer_names and match.group(3) != "scale":
        layer, module, kind = match.groups()
        if module == "attn_sinks":
            return f"model.layers.{layer}.{layer_names[module]}"
        return f"model.layers.{layer}.{layer_names[module]}.{kind}"
    match = _GGUF_BARE_LAYER_RE.fullmatch(gguf_name)  # Mamba's blk.N.ssm_a, without a kind
    if match and match.group(2) in layer_names:
        return f"model.layers.{match.group(1)}.{layer_names[match.group(2)]}"
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
    Of a split file (``path``: its first part) come the tensors of every part, in order.
    """
    # Our own header reader and a memory map: GGUFReader would spend seconds on the vocab.
    header = read_gguf_header(path)
    meta = header.metadata
    name = meta.get("general.architecture")
    if name not in ARCHITECTURES:
        raise ValueError(f"GGUF architecture {name!r} is not supported: {path}")
    arch = ARCHITECTURES[name]
    num_heads = int(meta[f"{name}.attention.head_count"])
    # (The largest: per layer, a hybrid's layers without attention count 0.)
    num_kv_heads = max(np.ravel(meta.get(f"{name}.attention.head_count_kv", num_heads)))
    # Only llama.cpp's llama converter (and its subclasses') permutes q/k; qwen2/qwen3
    # keep HF's layout.
    permuted_heads = {".self_attn.q_proj.": num_heads, ".self_attn.k_proj.": num_kv_heads}
    if not arch.permutes_qk:
        permuted_heads = {}
    parts = _OpenParts()
    try:
        yield from _tensors(header, parts, keep_quantized, arch, permuted_heads, dtype, device)
    finally:
        parts.close()


class _OpenParts:
    """The files a GGUF's tensors are read from (a split file's parts), each opened once, when
    its first tensor is read: mapped (copy-on-write: writable arrays for torch.from_numpy,
    and the file is never written) for the tensors dequantized, and open for reading for
    the quantized blocks, which are read, not mapped."""

    def __init__(self) -> None:
        self._maps: dict[str, np.ndarray] = {}
        self._files: dict[str, Any] = {}

    def mapped(self, path: str) -> np.ndarray:
        if path not in self._maps:
            self._maps[path] = np.memmap(path, dtype=np.uint8, mode="c")
        return self._maps[path]

    def file(self, path: str) -> Any:
        if path not in self._files:
            self._files[path] = open(path, "rb")  # noqa: SIM115 (closed by close())
        return self._files[path]

    def close(self) -> None:
        for file in self._files.values():
            file.close()
        self._files.clear()
        self._maps.clear()


def _tensors(
    header: GGUFHeader,
    parts: _OpenParts,
    keep_quantized: bool,
    arch: GGUFArch,
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
        name = hf_name(gguf_name, arch.name)
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
        path = header.file_of(gguf_name)  # a split file's part
        if keep_quantized and matrix and type_id in gguf_kernels.BLOCK_SIZES:
            blocks = gguf_kernels.anonymous_bytes(nbytes)  # freed to the system once repacked
            file = parts.file(path)
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
        raw = parts.mapped(path)[offset : offset + nbytes]
        weight = _dequantized(raw, qtype, shape, heads, device)
        if stacked:
            yield from _experts(name, weight.to(dtype).unbind(0))
            continue
        if name.endswith(".shared_expert_gate.weight"):
            weight = weight.reshape(1, -1)
        if arch.norms_plus_one and name.endswith("norm.weight"):
            # llama.cpp stores Gemma's (1 + w) norm weights with the 1 added; HF's are w.
            weight = weight - 1
        if arch.tensor_fix is not None:
            weight = arch.tensor_fix(name, weight)
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
