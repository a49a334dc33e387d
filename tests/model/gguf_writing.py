"""Writing test GGUF files with the gguf package, as llama.cpp's converter does: the steps
every family's writer in these tests shares."""

from __future__ import annotations

import numpy as np
import torch


def add_weight(writer, name: str, array: np.ndarray, qtype: str | None) -> torch.Tensor:
    """Add ``array`` to the file under llama.cpp's ``name``, as ``qtype`` blocks (gguf's
    reference quantizer) or, with None, as it is. Returns the weight the file holds
    (dequantized), the reference's weight."""
    import gguf

    if qtype is None:
        writer.add_tensor(name, array)
        return torch.from_numpy(array)
    ggml_type = gguf.GGMLQuantizationType[qtype]
    blocks = gguf.quants.quantize(array, ggml_type)
    writer.add_tensor(name, blocks, raw_dtype=ggml_type)
    return torch.from_numpy(gguf.quants.dequantize(blocks, ggml_type).copy())


def finish(writer) -> None:
    """Write the header, the metadata and the tensors, and close the file."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
