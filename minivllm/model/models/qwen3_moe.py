"""Qwen3-MoE: Qwen3's decoder (llama.py) with mixtures of experts in place of its MLPs.

A layer's MLP is sparse unless the config lists it in ``mlp_only_layers`` or it falls
between every ``decoder_sparse_step``-th layer; a dense one is Qwen3's MLP of
``intermediate_size``. The sparse block is a router (``gate``: hidden -> num_experts, no
bias) and ``num_experts`` SiLU-gated MLPs of ``moe_intermediate_size``, each token
summing its ``num_experts_per_tok`` best (fused_moe.py), their scores renormalised where
``norm_topk_prob`` says so.

Checkpoints name the experts one by one (``mlp.experts.{e}.gate_proj.weight``); the fused
3D tensors that transformers 5 holds in memory (``mlp.experts.gate_up_proj`` [E, 2I, H],
``mlp.experts.down_proj`` [E, H, I]) are taken too, cut into the same per-expert tensors.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from minivllm.distributed.parallel_state import TPGroup
from minivllm.model.layers.fused_moe import SparseMoeBlock, per_expert
from minivllm.model.layers.quantization.base import QuantizationConfig
from minivllm.model.models.llama import Qwen3ForCausalLM


class QwenMoeMixin:
    """The sparse layers of Qwen2-MoE and Qwen3-MoE, put before their dense model class."""

    supports_cuda_graphs = False  # the experts are picked on the host (fused_moe.py)
    expert_width = "moe_intermediate_size"  # the config field of an expert's width

    def make_mlp(
        self, config, layer: int, tp: TPGroup, quant_config: QuantizationConfig | None, prefix
    ) -> nn.Module | None:
        if not is_sparse_layer(config, layer):
            return None
        return SparseMoeBlock(
            config.hidden_size,
            config.num_experts,
            config.num_experts_per_tok,
            getattr(config, self.expert_width),
            self.renormalize(config),
            tp,
            quant_config,
            prefix,
            # Qwen2-MoE's shared expert; Qwen3-MoE has none.
            shared_intermediate_size=getattr(config, "shared_expert_intermediate_size", None),
        )

    def renormalize(self, config) -> bool:
        """Whether a token's top-k scores are renormalised to sum to 1."""
        return bool(getattr(config, "norm_topk_prob", False))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(per_expert(weights))


class Qwen3MoeForCausalLM(QwenMoeMixin, Qwen3ForCausalLM):
    pass


def is_sparse_layer(config, layer: int) -> bool:
    """Whether layer ``layer`` of a Qwen2/3-MoE config has experts (else a dense MLP)."""
    dense = getattr(config, "mlp_only_layers", None) or []
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return layer not in dense and config.num_experts > 0 and (layer + 1) % step == 0
