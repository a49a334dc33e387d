"""The int8k_int8v cache's rotated keys (attention/kv_rotation.py): the rotation is orthogonal and
fixed, and keys with outlier channels (Qwen2's k bias) lose far less through an int8 cache
stored rotated than unrotated, with the attention layer's output still attention over the
float keys (the scores unchanged by the rotation)."""

from __future__ import annotations

import pytest
import torch

from minivllm.attention.cpu import CPUAttentionBackend
from minivllm.attention.kv_quant import KVCacheFormat
from minivllm.attention.kv_rotation import rotation_matrix
from minivllm.kernels.cpu_kernels import load_kernels
from minivllm.model.layers.attention import Attention
from tests.attention.test_cpu_attention import HKV, H, common_metadata, dense_attention

BS = 4


@pytest.mark.parametrize("D", [64, 128, 80])
def test_the_rotation_is_orthogonal_and_fixed(D):
    r = rotation_matrix(D)
    torch.testing.assert_close(r @ r.T, torch.eye(D), atol=1e-5, rtol=0)
    rotation_matrix.cache_clear()
    assert torch.equal(rotation_matrix(D), r)  # the same in every process (a fixed seed)


def _attention_error(D: int, use_kernel: bool) -> float:
    """Max error of a 40-token prompt's attention through an int8 cache against float,
    keys with two outlier channels ~40x the others (as a k bias makes them)."""
    g = torch.Generator().manual_seed(0)
    T = 40
    q = torch.randn(T, H, D, generator=g)
    k = torch.randn(T, HKV, D, generator=g)
    k[..., 3] += 40.0
    k[..., 17] -= 30.0
    q[..., 3] *= 0.02  # the model's queries hardly look at the outlier channels
    q[..., 17] *= 0.02
    v = torch.randn(T, HKV, D, generator=g)
    backend = CPUAttentionBackend(BS, kv_cache_dtype="int8k_int8v")
    if not use_kernel:
        backend.kernels = backend.write_kernel = None
    layer = Attention(H, HKV, D, D**-0.5, backend)
    shape, dtype = backend.kv_cache_spec(T // BS, BS, HKV, D, torch.float32)
    layer.kv_cache = torch.zeros(shape, dtype=dtype)
    tables = [list(range(T // BS))]
    meta = backend.build_metadata(common_metadata([T], [T], tables, torch.arange(T)))
    out = layer(torch.arange(T), q, k, v, meta).view(T, H, D)
    return (out - dense_attention(q, k, v, D**-0.5)).abs().max().item()


@pytest.mark.parametrize("use_kernel", [False, True])
@pytest.mark.parametrize("D", [64, 80])
def test_rotated_keys_survive_outlier_channels(monkeypatch, use_kernel, D):
    if use_kernel and load_kernels("MINIVLLM_CPU_ATTN_KERNEL") is None:
        pytest.skip("no C compiler")
    rotated = _attention_error(D, use_kernel)
    monkeypatch.setattr(KVCacheFormat, "rotate_keys", property(lambda self: False))
    plain = _attention_error(D, use_kernel)
    assert rotated < 0.1
    assert rotated < plain / 3
