"""Granite 3.x MoE (ibm-granite/granite-3.*-1b-a400m, -3b-a800m): Granite (llama.py: its four
scales) with a mixture of experts in every layer: ``num_local_experts`` SiLU-gated experts
of ``intermediate_size``, each token summing its ``num_experts_per_tok`` best with their
softmax scores renormalised over the chosen (HF's softmax over the top-k logits: the same
weights). The block is fused_moe.py's ``SparseMoeBlock``, as Mixtral's.

Checkpoints name the block ``block_sparse_moe``, its router ``router.layer`` and hold every
expert's gate and up rows in one tensor ``input_linear`` [E, 2I, H] (gate first), the down
matrices in ``output_linear`` [E, H, I]; transformers 5 names them ``router`` and
``experts.gate_up_proj`` / ``experts.down_proj`` in memory. Both load under the layer's
names. The variant with a shared expert (GraniteMoeShared) is not supported.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from minivllm.distributed.parallel_state import TPGroup
from minivllm.model.layers.fused_moe import SparseMoeBlock, per_expert
from minivllm.model.layers.quantization.base import QuantizationConfig
from minivllm.model.models.llama import GraniteForCausalLM

# The block's checkpoint names (on disk, or transformers 5's) -> the layer's.
_RENAMES = {
    "input_linear.weight": "experts.gate_up_proj",
    "output_linear.weight": "experts.down_proj",
    "router.layer.weight": "gate.weight",
    "router.weight": "gate.weight",
}


class GraniteMoeForCausalLM(GraniteForCausalLM):
    supports_cuda_graphs = False  # the experts are picked on the host (fused_moe.py)

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
        return super().load_weights(per_expert(_renamed(weights)))


def _renamed(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        if ".block_sparse_moe." in name:
            block, rest = name.split(".block_sparse_moe.", 1)
            name = f"{block}.mlp.{_RENAMES.get(rest, rest)}"
        yield name, tensor
