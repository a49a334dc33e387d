"""Qwen3.5 (``Qwen3_5ForCausalLM``, ``Qwen3_5MoeForCausalLM``; the image-and-text
checkpoints, ``Qwen3_5ForConditionalGeneration`` and ``Qwen3_5MoeForConditionalGeneration``,
serve their text model): Qwen3-Next's hybrid layers (qwen3_next.py) with the DeltaNet's
input projections stored per kind (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``,
``in_proj_a``: the layout the engine fuses) and

- dense: Llama's SiLU-gated MLP in every layer;
- MoE: Qwen3-Next's sparse MLP with its gated shared expert in every layer, the top-k
  scores always renormalised (the config has no ``norm_topk_prob``).

Its RoPE is multimodal (sections of each head turned by time, height and width); a text
token has the three positions equal, which is ordinary partial RoPE.
"""

from __future__ import annotations

from minivllm.model.models.gemma3 import TextOfMultimodal
from minivllm.model.models.llama import LlamaForCausalLM
from minivllm.model.models.qwen3_moe import QwenMoeMixin
from minivllm.model.models.qwen3_next import HybridMixin


class Qwen3_5ForCausalLM(HybridMixin, LlamaForCausalLM):
    pass


class Qwen3_5MoeForCausalLM(HybridMixin, QwenMoeMixin, LlamaForCausalLM):
    def renormalize(self, config) -> bool:
        return True


class Qwen3_5ForConditionalGeneration(TextOfMultimodal, Qwen3_5ForCausalLM):
    """Qwen3.5's released checkpoints (text, images and video): the language model."""


class Qwen3_5MoeForConditionalGeneration(TextOfMultimodal, Qwen3_5MoeForCausalLM):
    pass
