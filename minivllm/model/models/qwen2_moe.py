"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's decoder (llama.py: q/k/v biases) with
Qwen3-MoE's sparse layers (qwen3_moe.py: which layers, the router, the routed experts) and
a shared expert in each: an MLP of ``shared_expert_intermediate_size`` that every token
runs, scaled by sigmoid(``shared_expert_gate``(x)) and added to the routed sum.
"""

from __future__ import annotations

from minivllm.model.models.llama import Qwen2ForCausalLM
from minivllm.model.models.qwen3_moe import QwenMoeMixin


class Qwen2MoeForCausalLM(QwenMoeMixin, Qwen2ForCausalLM):
    pass
