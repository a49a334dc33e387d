"""OLMoE (allenai/OLMoE-1B-7B): Llama's decoder with a mixture of experts in every layer
and RMSNorms of q and k over the whole projection, not per head.

Every layer is sparse: a router and ``num_experts`` SiLU-gated experts of
``intermediate_size`` (the config's only width), each token summing its
``num_experts_per_tok`` best, the scores as the softmax gives them unless
``norm_topk_prob``. The q/k norms span all heads, so one rank must hold all of them: a
tensor-parallel split is refused.
"""

from __future__ import annotations

from minivllm.distributed.parallel_state import TPGroup
from minivllm.model.layers.quantization.base import QuantizationConfig
from minivllm.model.models.llama import LlamaForCausalLM
from minivllm.model.models.qwen3_moe import QwenMoeMixin


class OlmoeForCausalLM(QwenMoeMixin, LlamaForCausalLM):
    qk_norm = "projection"
    expert_width = "intermediate_size"

    def __init__(
        self,
        config,
        backend,
        tp: TPGroup | None = None,
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        if tp is not None and tp.size > 1:
            raise ValueError(
                "OLMoE's q/k norms span every attention head, which tensor parallelism splits "
                "across ranks: use tensor_parallel_size=1"
            )
        super().__init__(config, backend, tp, quant_config)
