"""OLMo 2's refusal of a tensor-parallel split (its and OLMo 3's greedy parity with HF run
in test_hf_parity_archs.py, from a GGUF in test_loader.py)."""

from __future__ import annotations

import pytest

from minivllm.distributed.parallel_state import TPGroup


def test_olmo2_refuses_a_tensor_parallel_split():
    """Its q/k norms span all heads: a rank holding some of them cannot normalise."""
    from transformers import Olmo2Config

    from minivllm.model.models.olmo2 import Olmo2ForCausalLM
    from minivllm.platforms import get_platform

    config = Olmo2Config(hidden_size=64, num_attention_heads=4, num_hidden_layers=1)
    backend = get_platform("cpu").create_attn_backend(16)
    with pytest.raises(ValueError, match="tensor_parallel_size=1"):
        Olmo2ForCausalLM(config, backend, TPGroup(rank=0, size=2))
