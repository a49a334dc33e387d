"""ERNIE 4.5 (baidu/ERNIE-4.5-0.3B-PT and its dense siblings): Llama's network with RoPE
turning interleaved pairs of each head (dimensions 2i and 2i + 1), as GLM-4's: loading
reorders q_proj's and k_proj's rows into halves (glm4.py). The released configs set no
biases (use_bias false); the 0.3B model ties its LM head to the embedding.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from minivllm.model.models.glm4 import halves_from_pairs
from minivllm.model.models.llama import LlamaForCausalLM


class Ernie4_5ForCausalLM(LlamaForCausalLM):
    supports_pipeline_parallel = False  # reads layer 0 at build time

    def __init__(self, config, backend, tp=None, quant_config=None) -> None:
        if getattr(config, "use_bias", False):
            raise NotImplementedError("ERNIE 4.5 with use_bias (biases on every projection)")
        super().__init__(config, backend, tp, quant_config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        head_dim = self.model.layers[0].self_attn.head_dim
        return super().load_weights(halves_from_pairs(weights, head_dim, head_dim))
