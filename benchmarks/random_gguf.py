"""The part every random-weight GGUF writer of the benchmarks shares: a real file's tokenizer
copied over, then the tensors, quantized ones as random Q4_0 blocks with small fp16 scales
(values of about 0.01, so the residual stream stays finite) and the others as the writer's
own float32 data. The shape scripts (gguf_hybrid_shape.py, random_qwen2_gguf.py) name the
tensors and the architecture's keys."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

# (name, dims in PyTorch order, quantized)
Tensor = tuple[str, tuple[int, ...], bool]


def write_q4_0_tensors(
    writer,
    tokenizer_reader,
    tensors: list[Tensor],
    float_data: Callable[[str, tuple[int, ...], np.random.Generator], np.ndarray],
    seed: int = 0,
) -> int:
    """Finish ``writer`` (its architecture's keys already added): the tokenizer fields of
    ``tokenizer_reader`` (a GGUFReader), then ``tensors``; closes it and returns the tensor
    bytes. ``float_data`` gives an unquantized tensor's values (the one rng, in file order)."""
    from gguf import GGMLQuantizationType
    from gguf.constants import GGML_QUANT_SIZES

    for field in tokenizer_reader.fields.values():
        if field.name.startswith("tokenizer."):
            sub = field.types[1] if len(field.types) > 1 else None
            writer.add_key_value(field.name, field.contents(), field.types[0], sub)
    q4 = GGMLQuantizationType.Q4_0
    block, size = GGML_QUANT_SIZES[q4]
    total = 0
    for name, dims, quantized in tensors:
        count = int(np.prod(dims))
        if quantized:
            nbytes = count // block * size
            byte_shape = (*dims[:-1], dims[-1] // block * size)
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=q4)
        else:
            nbytes = count * 4
            writer.add_tensor_info(name, dims, np.dtype(np.float32), nbytes)
        total += nbytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, dims, quantized in tensors:
        if not quantized:
            data = float_data(name, dims, rng)
            writer.write_tensor_data(np.asarray(data, dtype=np.float32))
            continue
        rows = int(np.prod(dims[:-1]))
        blocks = rng.integers(0, 256, size=(rows * dims[-1] // block, size), dtype=np.uint8)
        scales = (rng.standard_normal(blocks.shape[0]) * 0.002).astype(np.float16)
        blocks[:, 0:2] = scales.view(np.uint8).reshape(-1, 2)
        writer.write_tensor_data(blocks.reshape(*dims[:-1], -1))
    writer.close()
    return total
