"""Tensor-parallel layers: each rank's weight_loader keeps the right slice of the full
checkpoint tensor, and the ranks' partial results combine into the unsharded result.

No process group is needed: the ranks are built side by side in this process, and the
collective (concatenate for column-parallel, sum for row-parallel) is done by hand.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minivllm.config import ParallelConfig
from minivllm.distributed.parallel_state import TPGroup
from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.create_config import check_engine_args, create_parallel_config
from minivllm.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minivllm.model.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)


def ranks(size: int) -> list[TPGroup]:
    return [TPGroup(rank=r, size=size) for r in range(size)]


def load(layer, name: str, tensor: torch.Tensor, shard_id=None) -> None:
    param = getattr(layer, name)
    if shard_id is None:
        param.weight_loader(param, tensor)
    else:
        param.weight_loader(param, tensor, shard_id)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def test_column_parallel_slices_concatenate_to_the_full_output():
    w, b, x = torch.randn(12, 8), torch.randn(12), torch.randn(5, 8)
    outs = []
    for tp in ranks(3):
        layer = ColumnParallelLinear(8, 12, bias=True, tp=tp)
        load(layer, "weight", w)
        load(layer, "bias", b)
        outs.append(layer(x))
    torch.testing.assert_close(torch.cat(outs, -1), F.linear(x, w, b))


def test_merged_gate_up_keeps_each_projections_slice():
    gate, up, x = torch.randn(12, 8), torch.randn(12, 8), torch.randn(5, 8)
    gates, ups = [], []
    for tp in ranks(2):
        layer = MergedColumnParallelLinear(8, {0: 12, 1: 12}, tp=tp)
        load(layer, "weight", gate, 0)
        load(layer, "weight", up, 1)
        g, u = layer(x).chunk(2, dim=-1)
        gates.append(g)
        ups.append(u)
    torch.testing.assert_close(torch.cat(gates, -1), x @ gate.T)
    torch.testing.assert_close(torch.cat(ups, -1), x @ up.T)


@pytest.mark.parametrize("num_kv_heads", [2, 1])  # split, and replicated on both ranks
def test_qkv_splits_by_heads(num_kv_heads):
    head_dim, heads, hidden = 4, 4, 8
    q = torch.randn(heads * head_dim, hidden)
    k = torch.randn(num_kv_heads * head_dim, hidden)
    v = torch.randn(num_kv_heads * head_dim, hidden)
    bias = {s: torch.randn(t.shape[0]) for s, t in (("q", q), ("k", k), ("v", v))}
    x = torch.randn(3, hidden)
    qs, ks, vs = [], [], []
    for tp in ranks(2):
        layer = QKVParallelLinear(hidden, head_dim, heads, num_kv_heads, bias=True, tp=tp)
        for shard, t in (("q", q), ("k", k), ("v", v)):
            load(layer, "weight", t, shard)
            load(layer, "bias", bias[shard], shard)
        assert layer.num_heads == 2 and layer.num_kv_heads == 1
        out_q, out_k, out_v = layer(x).split([layer.q_size, layer.kv_size, layer.kv_size], -1)
        qs.append(out_q)
        ks.append(out_k)
        vs.append(out_v)
    torch.testing.assert_close(torch.cat(qs, -1), F.linear(x, q, bias["q"]))
    if num_kv_heads == 2:
        torch.testing.assert_close(torch.cat(ks, -1), F.linear(x, k, bias["k"]))
        torch.testing.assert_close(torch.cat(vs, -1), F.linear(x, v, bias["v"]))
    else:  # both ranks hold the one KV head
        for out_k, out_v in zip(ks, vs):
            torch.testing.assert_close(out_k, F.linear(x, k, bias["k"]))
            torch.testing.assert_close(out_v, F.linear(x, v, bias["v"]))


def test_qkv_rejects_heads_that_do_not_divide():
    with pytest.raises(ValueError, match="num_attention_heads"):
        QKVParallelLinear(8, 4, 9, 3, bias=False, tp=TPGroup(rank=0, size=2))


def test_row_parallel_partials_sum_to_the_full_output():
    w, x = torch.randn(6, 12), torch.randn(5, 12)
    total = torch.zeros(5, 6)
    for tp in ranks(2):
        layer = RowParallelLinear(12, 6, tp=tp)
        load(layer, "weight", w)
        x_slice = x[:, tp.rank * 6 : (tp.rank + 1) * 6]  # what the column-parallel layer made
        total += F.linear(x_slice, layer.weight)  # the all-reduce, by hand
    torch.testing.assert_close(total, F.linear(x, w))


def test_vocab_parallel_embedding_and_head_cover_the_vocabulary_once():
    vocab, hidden = 10, 4  # 3 ranks: 4 rows each, the last two rows of rank 2 are padding
    table = torch.randn(vocab, hidden)
    ids = torch.tensor([0, 3, 4, 9, 7])
    h = torch.randn(2, hidden)
    embedded, logits = torch.zeros(len(ids), hidden), []
    for tp in ranks(3):
        emb = VocabParallelEmbedding(vocab, hidden, tp)
        load(emb, "weight", table)
        local = ids - emb.vocab_start
        mine = (local >= 0) & (local < emb.rows_per_rank)
        embedded[mine] += emb.weight[local[mine]]
        head = ParallelLMHead(vocab, hidden, tp, tied_to=emb)
        assert head.weight is emb.weight
        logits.append(F.linear(h, head.weight))
    assert emb.weight[2:].abs().sum() == 0  # padding rows
    torch.testing.assert_close(embedded, table[ids])
    torch.testing.assert_close(torch.cat(logits, -1)[:, :vocab], h @ table.T)


def test_one_rank_is_plain_linear_algebra():
    w, b, x = torch.randn(6, 8), torch.randn(6), torch.randn(3, 8)
    row = RowParallelLinear(8, 6, bias=True)
    load(row, "weight", w)
    row.bias.data.copy_(b)
    assert torch.equal(row(x), F.linear(x, w, b))
    table, ids = torch.randn(10, 8), torch.tensor([1, 9])
    emb = VocabParallelEmbedding(10, 8)
    load(emb, "weight", table)
    assert torch.equal(emb(ids), table[ids])
    head = ParallelLMHead(10, 8)
    load(head, "weight", table)
    assert torch.equal(head(x), F.linear(x, table).float())


class _Config:
    num_attention_heads = 9  # SmolLM2-135M
    num_key_value_heads = 3
    intermediate_size = 1536


@pytest.mark.parametrize(
    "heads, kv_heads, width, message",
    [
        (9, 3, 1536, "9 attention heads"),
        (8, 3, 1536, "3 key/value heads"),
        (8, 2, 1535, "MLP width of 1535"),
    ],
)
def test_parallel_config_says_why_a_model_cannot_be_split(heads, kv_heads, width, message):
    config = _Config()
    config.num_attention_heads, config.num_key_value_heads = heads, kv_heads
    config.intermediate_size = width
    with pytest.raises(ValueError, match=message):
        ParallelConfig(tensor_parallel_size=2).verify_with_model(config)
    ParallelConfig(tensor_parallel_size=1).verify_with_model(config)


@pytest.mark.parametrize("name", ["moe_intermediate_size", "shared_expert_intermediate_size"])
def test_parallel_config_checks_the_experts_width(name):
    config = _Config()
    config.num_attention_heads, config.num_key_value_heads = 8, 2
    setattr(config, name, 767)
    with pytest.raises(ValueError, match=f"expert MLP width of 767 \\({name}\\)"):
        ParallelConfig(tensor_parallel_size=2).verify_with_model(config)
    setattr(config, name, 768)
    ParallelConfig(tensor_parallel_size=2).verify_with_model(config)


def test_backend_defaults_and_checks():
    assert create_parallel_config(EngineArgs()).distributed_executor_backend == "uni"
    args = EngineArgs(tensor_parallel_size=2)
    assert create_parallel_config(args).distributed_executor_backend == "mp"
    for bad in (
        EngineArgs(tensor_parallel_size=0),
        EngineArgs(distributed_executor_backend="mpi"),
        EngineArgs(tensor_parallel_size=2, distributed_executor_backend="uni"),
    ):
        with pytest.raises(ValueError):
            check_engine_args(bad)
