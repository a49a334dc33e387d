"""Granite 3.x MoE (ibm-granite/granite-3.*-1b-a400m, -3b-a800m): Granite (llama.py: its four
scales) with a mixture of experts in every layer: ``num_local_experts`` SiLU-gated experts
of ``intermediate_size``, each token summing its ``num_experts_per_tok`` best with their
softmax scores renormalised over the chosen (HF's softmax over the top-k logits: the same
weights): Mixtral's block (mixtral.py), under other checkpoint names.

Checkpoints name the block ``block_sparse_moe``, its router ``router.layer`` and hold every
expert's gate and up rows in one tensor ``input_linear`` [E, 2I, H] (gate first), the down
matrices in ``output_linear`` [E, H, I]; transformers 5 names them ``router`` and
``experts.gate_up_proj`` / ``experts.down_proj`` in memory. Both load under the layer's
names. The variant with a shared expert (GraniteMoeShared) is not supported.
"""

from __future__ import annotations

from minivllm.model.models.llama import GraniteForCausalLM
from minivllm.model.models.mixtral import MixtralMoeMixin


class GraniteMoeForCausalLM(MixtralMoeMixin, GraniteForCausalLM):
    # The block's checkpoint names (on disk, or transformers 5's) -> the layer's; per_expert
    # then cuts the fused experts.gate_up_proj / down_proj into each expert's matrices.
    checkpoint_renames = {
        ".block_sparse_moe.": ".mlp.",
        ".input_linear.weight": ".experts.gate_up_proj",
        ".output_linear.weight": ".experts.down_proj",
        ".router.layer.weight": ".gate.weight",
        ".router.weight": ".gate.weight",
    }
