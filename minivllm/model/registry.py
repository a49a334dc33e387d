"""Which class implements each architecture named in a HF config."""

from __future__ import annotations

from minivllm.config import SEQUENCE_CLASSIFIER
from minivllm.model.models.ernie4_5 import Ernie4_5ForCausalLM
from minivllm.model.models.gemma3 import (
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3ForConditionalGeneration,
)
from minivllm.model.models.gemma4 import Gemma4ForCausalLM, Gemma4ForConditionalGeneration
from minivllm.model.models.glm4 import Glm4ForCausalLM
from minivllm.model.models.gpt_oss import GptOssForCausalLM
from minivllm.model.models.granitemoe import GraniteMoeForCausalLM
from minivllm.model.models.granitemoehybrid import GraniteMoeHybridForCausalLM
from minivllm.model.models.lfm2 import Lfm2ForCausalLM
from minivllm.model.models.llama import (
    GraniteForCausalLM,
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
    SmolLM3ForCausalLM,
)
from minivllm.model.models.mixtral import MixtralForCausalLM
from minivllm.model.models.olmo2 import Olmo2ForCausalLM, Olmo3ForCausalLM
from minivllm.model.models.olmoe import OlmoeForCausalLM
from minivllm.model.models.opt import OPTForCausalLM
from minivllm.model.models.phi3 import Phi3ForCausalLM
from minivllm.model.models.qwen2_moe import Qwen2MoeForCausalLM
from minivllm.model.models.qwen3_5 import (
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeForConditionalGeneration,
)
from minivllm.model.models.qwen3_moe import Qwen3MoeForCausalLM
from minivllm.model.models.qwen3_next import Qwen3NextForCausalLM

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "OPTForCausalLM": OPTForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma4ForCausalLM": Gemma4ForCausalLM,
    "Gemma4ForConditionalGeneration": Gemma4ForConditionalGeneration,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
    "SmolLM3ForCausalLM": SmolLM3ForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "Olmo3ForCausalLM": Olmo3ForCausalLM,
    "GraniteMoeForCausalLM": GraniteMoeForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "Glm4ForCausalLM": Glm4ForCausalLM,
    "Ernie4_5ForCausalLM": Ernie4_5ForCausalLM,
    "Lfm2ForCausalLM": Lfm2ForCausalLM,
    "GraniteMoeHybridForCausalLM": GraniteMoeHybridForCausalLM,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM,
    "Qwen3_5ForConditionalGeneration": Qwen3_5ForConditionalGeneration,
    "Qwen3_5MoeForConditionalGeneration": Qwen3_5MoeForConditionalGeneration,
}


def resolve_model_class(config) -> type:
    architectures = getattr(config, "architectures", None) or []
    for arch in architectures:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
        # An embedding model's checkpoint names the bare network ("Qwen3Model") and a
        # classifier's its head ("Qwen3ForSequenceClassification"): the same layers as the
        # causal LM's, whose LM head the pooling runner drops.
        for suffix in ("Model", SEQUENCE_CLASSIFIER):
            base = arch[: -len(suffix)] + "ForCausalLM"
            if arch.endswith(suffix) and base in MODEL_REGISTRY:
                return MODEL_REGISTRY[base]
    raise ValueError(
        f"Model architectures {architectures} are not supported. "
        f"Supported architectures: {sorted(MODEL_REGISTRY)}"
    )
