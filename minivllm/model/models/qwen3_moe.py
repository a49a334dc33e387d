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

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from minivllm.distributed.parallel_state import TPGroup
from minivllm.model.layers.fused_moe import FusedMoE
from minivllm.model.layers.linear import Linear
from minivllm.model.layers.quantization.base import QuantizationConfig
from minivllm.model.models.llama import Qwen3ForCausalLM


class Qwen3MoeSparseMoeBlock(nn.Module):
    """The router and the experts, named as in the checkpoints (``mlp.gate``,
    ``mlp.experts.{e}``)."""

    def __init__(
        self,
        config,
        tp: TPGroup,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        # Replicated: every rank routes every token, the same way.
        self.gate = Linear(
            config.hidden_size, config.num_experts, False, quant_config, f"{prefix}.gate"
        )
        self.experts = FusedMoE(
            config.num_experts,
            config.num_experts_per_tok,
            config.hidden_size,
            config.moe_intermediate_size,
            bool(getattr(config, "norm_topk_prob", False)),
            tp,
            quant_config,
            f"{prefix}.experts",
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def make_mlp(
        self, config, layer: int, tp: TPGroup, quant_config: QuantizationConfig | None, prefix
    ) -> nn.Module | None:
        dense = getattr(config, "mlp_only_layers", None) or []
        step = getattr(config, "decoder_sparse_step", 1) or 1
        if layer in dense or config.num_experts == 0 or (layer + 1) % step:
            return None
        return Qwen3MoeSparseMoeBlock(config, tp, quant_config, prefix)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(_per_expert(weights))


def _per_expert(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Fused 3D expert tensors cut into the checkpoints' per-expert names; the rest as is."""
    for name, tensor in weights:
        if name.endswith(".experts.gate_up_proj"):
            experts = name.removesuffix("gate_up_proj")
            for e, gate_up in enumerate(tensor):
                gate, up = gate_up.chunk(2, dim=0)
                yield f"{experts}{e}.gate_proj.weight", gate
                yield f"{experts}{e}.up_proj.weight", up
        elif name.endswith(".experts.down_proj"):
            experts = name.removesuffix("down_proj")
            for e, down in enumerate(tensor):
                yield f"{experts}{e}.down_proj.weight", down
        else:
            yield name, tensor
