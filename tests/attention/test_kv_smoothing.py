"""The int8k_int8v cache's smoothed keys (attention/kv_smoothing.py): each key channel is
stored divided by its layer's power-of-two factor and each query multiplied by it, so
scores are unchanged, and keys with outlier channels (Qwen2's k bias) lose far less through
the cache's one int8 scale a row than unsmoothed."""

from __future__ import annotations

import pytest
import torch

from minivllm.attention.cpu import CPUAttentionBackend
from minivllm.attention.kv_smoothing import calibration_ids, key_factors
from minivllm.kernels.cpu_kernels import load_kernels
from minivllm.model.layers.attention import Attention
from tests.attention.test_cpu_attention import HKV, H, common_metadata, dense_attention

BS = 4


def test_factors_are_powers_of_two_that_bring_outliers_to_the_median():
    amax = torch.ones(2, 8)
    amax[0, 3] = 40.0  # 40x the median: 64
    amax[1, 5] = 2.0  # exactly 2x: 2
    amax[1, 6] = 0.25  # below the median: 1
    f = key_factors(amax)
    expected = torch.ones(2, 8)
    expected[0, 3], expected[1, 5] = 64.0, 2.0
    assert torch.equal(f, expected)
    assert torch.equal(key_factors(torch.zeros(2, 8)), torch.ones(2, 8))  # an idle head
    nan = torch.ones(1, 4)
    nan[0, 1] = float("nan")
    assert torch.equal(key_factors(nan), torch.ones(1, 4))


def test_calibration_ids_are_the_same_every_time():
    a = calibration_ids(1000, 64)
    assert torch.equal(a, calibration_ids(1000, 64))
    assert int(a.min()) >= 0 and int(a.max()) < 1000 and a.unique().numel() > 40


def _layer(D: int, use_kernel: bool) -> Attention:
    backend = CPUAttentionBackend(BS, kv_cache_dtype="int8k_int8v")
    if not use_kernel:
        backend.kernels = backend.write_kernel = None
    return Attention(H, HKV, D, D**-0.5, backend)


def _prompt(layer: Attention, q, k, v) -> torch.Tensor:
    T, D = q.shape[0], q.shape[-1]
    shape, dtype = layer.backend.kv_cache_spec(T // BS, BS, HKV, D, torch.float32)
    layer.kv_cache = torch.zeros(shape, dtype=dtype)
    meta = layer.backend.build_metadata(
        common_metadata([T], [T], [list(range(T // BS))], torch.arange(T))
    )
    return layer(torch.arange(T), q, k, v, meta).view(T, H, D)


def _outlier_inputs(D: int):
    """A 40-token prompt whose keys have two outlier channels ~40x the others (as a k bias
    makes them)."""
    g = torch.Generator().manual_seed(0)
    T = 40
    q = torch.randn(T, H, D, generator=g)
    k = torch.randn(T, HKV, D, generator=g)
    k[..., 3] += 40.0
    k[..., 17] -= 30.0
    q[..., 3] *= 0.02  # the model's queries hardly look at the outlier channels
    q[..., 17] *= 0.02
    return q, k, torch.randn(T, HKV, D, generator=g)


@pytest.mark.parametrize("use_kernel", [False, True])
@pytest.mark.parametrize("D", [64, 80])
def test_smoothed_keys_survive_outlier_channels(use_kernel, D):
    if use_kernel and load_kernels("MINIVLLM_CPU_ATTN_KERNEL") is None:
        pytest.skip("no C compiler")
    q, k, v = _outlier_inputs(D)
    expected = dense_attention(q, k, v, D**-0.5)
    plain = (_prompt(_layer(D, use_kernel), q, k, v) - expected).abs().max().item()
    # Calibrated on other inputs with the same outlier channels (the weights' property).
    layer = _layer(D, use_kernel)
    layer.begin_key_calibration()
    calib_q, calib_k, calib_v = _outlier_inputs(D)
    calib_k += torch.randn(calib_k.shape, generator=torch.Generator().manual_seed(1))
    _prompt(layer, calib_q, calib_k, calib_v)
    layer.end_key_calibration(torch.float32, torch.device("cpu"))
    assert layer.key_factors[:, 3].min() >= 8 and layer.key_factors[:, 17].min() >= 8
    others = [c for c in range(D) if c not in (3, 17)]
    assert layer.key_factors[:, others].max() <= 2  # at most up to the median's power of 2
    smoothed = (_prompt(layer, q, k, v) - expected).abs().max().item()
    assert smoothed < 0.05
    assert smoothed < plain / 5


def test_smoothing_leaves_a_float_caches_scores_unchanged(monkeypatch):
    """With a float cache the same factors change nothing bit for bit: a power of two only
    moves the exponent of q and k, so q . k is the same number."""
    from minivllm.attention.kv_quant import KVCacheFormat

    D = 64
    q, k, v = _outlier_inputs(D)
    backend = CPUAttentionBackend(BS)
    layer = Attention(H, HKV, D, D**-0.5, backend)
    expected = _prompt(layer, q, k, v)
    factors = key_factors(k.abs().amax(0))
    assert factors.max() > 1
    layer.set_key_factors(factors, torch.float32, torch.device("cpu"))
    monkeypatch.setattr(KVCacheFormat, "smooth_keys", property(lambda self: True))
    got = _prompt(layer, q, k, v)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
