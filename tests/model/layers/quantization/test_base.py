"""UnquantizedLinearMethod against F.linear: oneDNN on a packed copy, the small-batch C
kernel on panels up to SMALL_BATCH_ROWS rows, plain F.linear where packing is off or does
not apply; a weight another module reads is left to it as panels, or plain."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minivllm.kernels.cpu_kernels import load_kernels
from minivllm.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minivllm.model.layers.linear import Linear, RowParallelLinear
from minivllm.model.layers.quantization.base import SMALL_BATCH_ROWS, UnquantizedLinearMethod
from minivllm.model.weight_loading import process_weights_after_loading

KERNEL = "MINIVLLM_CPU_SMALL_BATCH_LINEAR"
PACKING = "MINIVLLM_CPU_PACKED_LINEAR"
has_kernel = load_kernels(KERNEL) is not None
ROWS = (1, 2, 5, 9, 64, SMALL_BATCH_ROWS, SMALL_BATCH_ROWS + 1, 300)


def filled_linear(dtype=torch.float32) -> tuple[Linear, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    layer = Linear(96, 80, bias=True)
    weight, bias = torch.randn(80, 96, dtype=dtype), torch.randn(80, dtype=dtype)
    layer.weight.data = weight.clone()
    layer.bias.data = bias.clone()
    return layer, weight, bias


@pytest.mark.parametrize(
    "kernel", [pytest.param("1", marks=pytest.mark.skipif(not has_kernel, reason="no cc")), "0"]
)
def test_matches_f_linear_at_small_and_large_batch(monkeypatch, kernel):
    monkeypatch.setenv(KERNEL, kernel)
    layer, weight, bias = filled_linear()
    process_weights_after_loading(layer)
    method = layer.quant_method
    assert isinstance(method, UnquantizedLinearMethod)
    assert method.packed_weight is not None
    assert (method.panels is not None) == (kernel == "1")  # 80 rows: 5 panels of 16
    assert layer.weight.numel() == 0  # only the packed copies are read
    for m in ROWS:
        x = torch.randn(m, 96)
        torch.testing.assert_close(layer(x), F.linear(x, weight, bias), atol=1e-4, rtol=1e-5)
    x = torch.randn(2, 3, 96)  # a leading batch dimension goes to oneDNN
    torch.testing.assert_close(layer(x), F.linear(x, weight, bias), atol=1e-4, rtol=1e-5)


def test_packing_off_or_not_float32_stays_plain_f_linear(monkeypatch):
    monkeypatch.setenv(PACKING, "0")
    layer, weight, bias = filled_linear()
    process_weights_after_loading(layer)
    assert layer.quant_method.packed_weight is None
    assert torch.equal(layer.weight, weight)
    x = torch.randn(2, 96)
    assert torch.equal(layer(x), F.linear(x, weight, bias))
    monkeypatch.setenv(PACKING, "1")
    layer, weight, bias = filled_linear(torch.bfloat16)
    process_weights_after_loading(layer)
    assert layer.quant_method.packed_weight is None
    x = torch.randn(2, 96, dtype=torch.bfloat16)
    assert torch.equal(layer(x), F.linear(x, weight, bias))


def test_a_tied_head_keeps_the_embeddings_weight_and_an_untied_one_drops_its_own(monkeypatch):
    monkeypatch.setenv(KERNEL, "0")  # no panels: oneDNN at every batch
    table = torch.randn(50, 32)
    emb = VocabParallelEmbedding(50, 32)
    emb.weight.data.copy_(table)
    tied = ParallelLMHead(50, 32, tied_to=emb)
    untied = ParallelLMHead(50, 32)
    untied.weight.data.copy_(table)
    row = RowParallelLinear(32, 50)
    row.weight.data.copy_(table)
    for layer in (tied, untied, row):
        process_weights_after_loading(layer)
    assert torch.equal(emb.weight, table)
    assert untied.weight.numel() == 0 and row.weight.numel() == 0
    ids = torch.tensor([3, 49])
    assert torch.equal(emb(ids), table[ids])
    x = torch.randn(SMALL_BATCH_ROWS + 2, 32)
    for layer in (tied, untied, row):
        torch.testing.assert_close(layer(x), x @ table.T, atol=1e-4, rtol=1e-5)


@pytest.mark.skipif(not has_kernel, reason="no cc")
@pytest.mark.parametrize("kernel", ["1", "0"])
def test_a_tied_embedding_gathers_its_rows_from_the_heads_panels(monkeypatch, kernel):
    # 50 rows: 4 panels of 16, the last with 2 rows and zeros. Only one copy in float32
    # layout besides oneDNN's is kept.
    monkeypatch.setenv(KERNEL, kernel)
    table = torch.randn(50, 32)
    emb = VocabParallelEmbedding(50, 32)
    emb.weight.data.copy_(table)
    head = ParallelLMHead(50, 32, tied_to=emb)
    process_weights_after_loading(head)
    if kernel == "1":
        assert emb.weight.numel() == 0 and emb.weight.panels is head.quant_method.panels
    else:
        assert torch.equal(emb.weight, table)  # no panels: the table stays plain
    ids = torch.tensor([0, 15, 16, 17, 49, 40, 40])
    assert torch.equal(emb(ids), table[ids])
    for m in (1, 7, SMALL_BATCH_ROWS + 2):
        x = torch.randn(m, 32)
        torch.testing.assert_close(head(x), x @ table.T, atol=1e-4, rtol=1e-5)
