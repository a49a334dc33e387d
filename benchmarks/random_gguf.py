"""The part every random-weight GGUF writer of the benchmarks shares: a real file's tokenizer
copied over, then the tensors, quantized ones as random blocks whose scale bytes are set to
small finite values (so the residual stream stays finite) and the others as the writer's own
float32 data. The shape scripts (gguf_hybrid_shape.py, random_qwen2_gguf.py,
gguf_moe_shape.py, gguf_scale.py, gguf_gemma4_shape.py) name the tensors, their types and the
architecture's keys; a script whose files must stay as they were passes its own block filler
(each filler draws from the one rng in file order, so the bytes depend on it)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

Q4 = "Q4_0"
# (name, dims in PyTorch order, a quantized tensor's GGML type name or None for float32)
Tensor = tuple[str, tuple[int, ...], str | None]
FloatData = Callable[[str, tuple[int, ...], np.random.Generator], np.ndarray]
# (type name, the tensor's random blocks as a (blocks, block bytes) uint8 array, the rng):
# sets the blocks' scale bytes in place
BlockFiller = Callable[[str, np.ndarray, np.random.Generator], None]


def tensor_bytes(dims: tuple[int, ...], kind: str | None) -> int:
    """A tensor's bytes in the file: float32, or whole blocks of ``kind`` along its rows."""
    from gguf import GGMLQuantizationType
    from gguf.constants import GGML_QUANT_SIZES

    count = int(np.prod(dims))
    if kind is None:
        return count * 4
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    return count // block * size


def small_scales(kind: str, blocks: np.ndarray, rng: np.random.Generator) -> None:
    """Q4_0's (and Q5_0's, Q8_0's) fp16 scale at bytes 0-1: about 0.002 x N(0, 1)."""
    scales = (rng.standard_normal(blocks.shape[0]) * 0.002).astype(np.float16)
    blocks[:, 0:2] = scales.view(np.uint8).reshape(-1, 2)


def write_tensors(
    writer,
    tensors: list[Tensor],
    float_data: FloatData,
    *,
    tokenizer_reader=None,
    fill_blocks: BlockFiller = small_scales,
    seed: int = 0,
) -> int:
    """Finish ``writer`` (its architecture's keys already added): the tokenizer fields of
    ``tokenizer_reader`` (a GGUFReader; None: none), then ``tensors``; closes it and returns
    the tensor bytes. ``float_data`` gives an unquantized tensor's values, ``fill_blocks`` a
    quantized one's scales (both from the one rng, in file order)."""
    from gguf import GGMLQuantizationType
    from gguf.constants import GGML_QUANT_SIZES

    if tokenizer_reader is not None:
        for field in tokenizer_reader.fields.values():
            if field.name.startswith("tokenizer."):
                sub = field.types[1] if len(field.types) > 1 else None
                writer.add_key_value(field.name, field.contents(), field.types[0], sub)
    total = 0
    for name, dims, kind in tensors:
        nbytes = tensor_bytes(dims, kind)
        if kind is None:
            writer.add_tensor_info(name, dims, np.dtype(np.float32), nbytes)
        else:
            qtype = GGMLQuantizationType[kind]
            block, size = GGML_QUANT_SIZES[qtype]
            byte_shape = (*dims[:-1], dims[-1] // block * size)  # uint8 rows: gguf takes bytes
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=qtype)
        total += nbytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, dims, kind in tensors:
        if kind is None:
            data = float_data(name, dims, rng)
            writer.write_tensor_data(np.asarray(data, dtype=np.float32))
            continue
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
        rows = int(np.prod(dims[:-1]))
        blocks = rng.integers(0, 256, size=(rows * dims[-1] // block, size), dtype=np.uint8)
        fill_blocks(kind, blocks, rng)
        writer.write_tensor_data(blocks.reshape(*dims[:-1], -1))
    writer.close()
    return total
