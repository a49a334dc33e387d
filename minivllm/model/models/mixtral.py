"""Mixtral: Mistral's decoder (llama.py: no q/k norms, the config's sliding window) with a
mixture of experts in every layer: ``num_local_experts`` SiLU-gated experts of
``intermediate_size``, each token summing its ``num_experts_per_tok`` best with their
softmax scores renormalised over the chosen (HF's softmax over the top-k logits: the same
weights). The block is fused_moe.py's ``SparseMoeBlock``, as Qwen3-MoE's.

Checkpoints name the block ``block_sparse_moe`` and each expert's matrices ``w1`` (gate),
``w3`` (up) and ``w2`` (down); they load under the layer's names (``mlp.gate``,
``mlp.experts.{e}.gate_proj`` ...), as do transformers 5's fused 3D tensors.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from minivllm.distributed.parallel_state import TPGroup
from minivllm.model.layers.fused_moe import SparseMoeBlock, per_expert
from minivllm.model.layers.quantization.base import QuantizationConfig
from minivllm.model.models.llama import MistralForCausalLM


class MixtralMoeMixin:
    """Mixtral's expert block (every layer; Granite MoE's too), put before the dense model
    class. ``checkpoint_renames``: substrings of the block's checkpoint names (those under
    ``block_sparse_moe``) -> the layer's."""

    supports_cuda_graphs = False  # the experts are picked on the host (fused_moe.py)
    checkpoint_renames = {
        ".block_sparse_moe.": ".mlp.",
        ".w1.": ".gate_proj.",
        ".w3.": ".up_proj.",
        ".w2.": ".down_proj.",
    }

    def make_mlp(
        self, config, layer: int, tp: TPGroup, quant_config: QuantizationConfig | None, prefix
    ) -> nn.Module | None:
        return SparseMoeBlock(
            config.hidden_size,
            config.num_local_experts,
            config.num_experts_per_tok,
            config.intermediate_size,
            True,
            tp,
            quant_config,
            prefix,
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(per_expert(self._renamed(weights)))

    def _renamed(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if ".block_sparse_moe." in name:
                for old, new in self.checkpoint_renames.items():
                    name = name.replace(old, new)
            yield name, tensor


class MixtralForCausalLM(MixtralMoeMixin, MistralForCausalLM):
    pass
