"""Every linear layer is a ``LinearBase`` whose ``quant_method`` the model's ``quant_config``
picks, asked with the layer's name in the model (its prefix); the forward runs the method."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers

from minivllm.attention.cpu import CPUAttentionBackend
from minivllm.distributed.parallel_state import TPGroup
from minivllm.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minivllm.model.layers.linear import (
    ColumnParallelLinear,
    Linear,
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from minivllm.model.layers.quantization import get_quantization_config
from minivllm.model.layers.quantization.base import QuantizationConfig, UnquantizedLinearMethod
from minivllm.model.layers.quantization.gguf import GGUFConfig, GGUFLinearMethod
from minivllm.model.models.gemma3 import Gemma3ForCausalLM
from minivllm.model.models.llama import LlamaForCausalLM
from minivllm.model.models.opt import OPTForCausalLM


class DoublingMethod(UnquantizedLinearMethod):
    """Dense, with the output doubled: a test sees that this method ran."""

    def apply(self, layer, x, bias=None):
        return 2 * super().apply(layer, x, bias)


class PickBySuffix(QuantizationConfig):
    """Gives a DoublingMethod to the layers whose prefix ends with one of ``suffixes``, and
    remembers the prefix each layer was asked with."""

    def __init__(self, *suffixes: str) -> None:
        self.suffixes = suffixes
        self.prefixes: dict[int, str] = {}  # id(layer) -> prefix

    def get_name(self) -> str:
        return "pick-by-suffix"

    def get_quant_method(self, layer, prefix):
        self.prefixes[id(layer)] = prefix
        return DoublingMethod() if prefix.endswith(self.suffixes) else None


TINY = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def tiny_models():
    llama = transformers.LlamaConfig(**TINY)
    opt = transformers.OPTConfig(
        vocab_size=64,
        hidden_size=32,
        word_embed_proj_dim=16,  # project_in / project_out exist
        ffn_dim=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
    )
    gemma = transformers.Gemma3TextConfig(**TINY, head_dim=8, sliding_window=8)
    return [
        (LlamaForCausalLM, llama, ".mlp.down_proj"),
        (OPTForCausalLM, opt, ".fc1"),
        (Gemma3ForCausalLM, gemma, ".self_attn.qkv_proj"),
    ]


@pytest.mark.parametrize("model_cls, hf_config, suffix", tiny_models())
def test_each_layer_is_asked_with_its_name_and_gets_the_method_picked(model_cls, hf_config, suffix):
    config = PickBySuffix(suffix)
    model = model_cls(hf_config, CPUAttentionBackend(16), quant_config=config)
    with_method = {
        name: module for name, module in model.named_modules() if hasattr(module, "quant_method")
    }
    # Every linear layer and the LM head have a method, and nothing else does.
    assert all(isinstance(m, (LinearBase, ParallelLMHead)) for m in with_method.values())
    assert sum(isinstance(m, LinearBase) for m in model.modules()) == len(with_method) - 1
    assert {config.prefixes[id(m)] for m in with_method.values()} == set(with_method)
    for name, module in with_method.items():
        picked = isinstance(module.quant_method, DoublingMethod)
        assert picked == name.endswith(suffix), name
        assert isinstance(module.quant_method, UnquantizedLinearMethod)
    assert sum(isinstance(m.quant_method, DoublingMethod) for m in with_method.values()) == 2


def _filled(layer: LinearBase) -> LinearBase:
    torch.nn.init.normal_(layer.weight)
    if layer.bias is not None:
        torch.nn.init.normal_(layer.bias)
    return layer


@pytest.mark.parametrize(
    "make",
    [
        lambda q: Linear(16, 8, bias=True, quant_config=q),
        lambda q: ColumnParallelLinear(16, 8, bias=True, quant_config=q),
        lambda q: MergedColumnParallelLinear(16, {0: 8, 1: 4}, bias=True, quant_config=q),
        lambda q: QKVParallelLinear(16, 4, 2, 1, bias=True, quant_config=q),
        lambda q: RowParallelLinear(16, 8, bias=True, quant_config=q),
    ],
    ids=["replicated", "column", "merged", "qkv", "row"],
)
def test_forward_is_the_methods_apply(make):
    x = torch.randn(3, 16)
    dense = _filled(make(None))
    assert type(dense.quant_method) is UnquantizedLinearMethod
    torch.testing.assert_close(dense(x), F.linear(x, dense.weight, dense.bias))
    doubled = _filled(make(PickBySuffix("")))
    assert type(doubled.quant_method) is DoublingMethod
    torch.testing.assert_close(doubled(x), 2 * F.linear(x, doubled.weight, doubled.bias))


def test_gguf_picks_its_method_for_linear_layers_and_the_head_only():
    gguf = GGUFConfig()
    assert gguf.get_name() == "gguf"
    tp = TPGroup()
    emb = VocabParallelEmbedding(64, 16, tp)
    head = ParallelLMHead(64, 16, tp, tied_to=emb, quant_config=gguf)
    assert isinstance(head.quant_method, GGUFLinearMethod)
    assert gguf.get_quant_method(emb, "model.embed_tokens") is None
    assert isinstance(RowParallelLinear(16, 8, quant_config=gguf).quant_method, GGUFLinearMethod)


def test_quantization_names_resolve_to_configs():
    assert get_quantization_config(None) is None
    assert isinstance(get_quantization_config("gguf"), GGUFConfig)
    with pytest.raises(ValueError, match="Unknown quantization 'awq'"):
        get_quantization_config("awq")
