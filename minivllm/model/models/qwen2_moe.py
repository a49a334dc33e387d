"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's decoder (llama.py: q/k/v biases) with
Qwen3-MoE's sparse layers (qwen3_moe.py: which layers, the router, the routed experts) and
a shared expert in each: an MLP of ``shared_expert_intermediate_size`` that every token
runs, scaled by sigmoid(``shared_expert_gate``(x)) and added to the routed sum.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from minivllm.distributed.parallel_state import TPGroup
from minivllm.model.layers.fused_moe import SparseMoeBlock, per_expert
from minivllm.model.layers.quantization.base import QuantizationConfig
from minivllm.model.models.llama import Qwen2ForCausalLM
from minivllm.model.models.qwen3_moe import is_sparse_layer


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    supports_cuda_graphs = False  # the experts are picked on the host (fused_moe.py)

    def make_mlp(
        self, config, layer: int, tp: TPGroup, quant_config: QuantizationConfig | None, prefix
    ) -> nn.Module | None:
        if not is_sparse_layer(config, layer):
            return None
        return SparseMoeBlock(
            config.hidden_size,
            config.num_experts,
            config.num_experts_per_tok,
            config.moe_intermediate_size,
            bool(getattr(config, "norm_topk_prob", False)),
            tp,
            quant_config,
            prefix,
            shared_intermediate_size=config.shared_expert_intermediate_size,
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(per_expert(weights))
