"""OLMoE (allenai/OLMoE-1B-7B): Llama's decoder with a mixture of experts in every layer
and RMSNorms of q and k over the whole projection, not per head.

Every layer is sparse: a router and ``num_experts`` SiLU-gated experts of
``intermediate_size`` (the config's only width), each token summing its
``num_experts_per_tok`` best, the scores as the softmax gives them unless
``norm_topk_prob``. The q/k norms span all heads, so one rank must hold all of them:
LlamaAttention refuses a tensor-parallel split.
"""

from __future__ import annotations

from minivllm.model.models.llama import LlamaForCausalLM
from minivllm.model.models.qwen3_moe import QwenMoeMixin


class OlmoeForCausalLM(QwenMoeMixin, LlamaForCausalLM):
    qk_norm = "projection"
    expert_width = "intermediate_size"
