"""MXFP4, as Hugging Face checkpoints hold it (gpt-oss's experts, as released): per matrix,
``*_blocks`` [..., rows, K / 32, 16] bytes (two 4-bit E2M1 elements each, element 2i in
byte i's low nibble and 2i + 1 in its high one) and ``*_scales`` [..., rows, K / 32] E8M0
exponents (2^(s - 127)), one per 32 elements. A matrix is dequantized at load, or kept in
a format that multiplies MXFP4 (``QuantizationConfig.mxfp4_matrix``: GGUF's blocks)."""

from __future__ import annotations

import torch

from minivllm.model.layers.quantization.base import QuantizationConfig, QuantizedTensor

# The 16 values of a 4-bit E2M1 number (MXFP4's elements): sign, 2 exponent bits, 1 mantissa.
_FP4_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_FP4_VALUES = _FP4_MAGNITUDES + tuple(-v for v in _FP4_MAGNITUDES)


def mxfp4_matrix(
    blocks: torch.Tensor, scales: torch.Tensor, quant_config: QuantizationConfig | None
) -> torch.Tensor | QuantizedTensor:
    """One checkpoint matrix [rows, K]: in ``quant_config``'s format where it keeps MXFP4,
    else dequantized to float32."""
    if quant_config is not None:
        kept = quant_config.mxfp4_matrix(blocks, scales)
        if kept is not None:
            return kept
    return dequantize_mxfp4(blocks, scales)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[..., rows, K / 32, 16] bytes and [..., rows, K / 32] exponents -> [..., rows, K]
    float32."""
    table = torch.tensor(_FP4_VALUES, dtype=torch.float32)
    values = table[_fp4_elements(blocks).long()]  # [..., rows, K / 32, 32]
    values = torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - 127)
    return values.flatten(-2)


def mxfp4_as_gguf_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Hugging Face's MXFP4 -> GGUF's MXFP4 blocks [..., K / 32 * 17]: the exponent byte
    (the same: GGUF doubles the values and halves the scale), then 16 bytes holding
    element j in the low nibble and j + 16 in the high one."""
    elements = _fp4_elements(blocks)
    packed = elements[..., :16] | (elements[..., 16:] << 4)
    out = torch.cat([scales.unsqueeze(-1), packed], dim=-1)  # [..., K / 32, 17]
    return out.flatten(-2)


def _fp4_elements(blocks: torch.Tensor) -> torch.Tensor:
    """MXFP4 bytes [..., 16] -> the 32 elements' 4-bit codes [..., 32], in order: element
    2i is byte i's low nibble, 2i + 1 its high one."""
    return torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2)
