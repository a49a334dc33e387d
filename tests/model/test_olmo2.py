"""OLMo 2's refusals (its greedy parity with HF runs in test_hf_parity_archs.py, from a GGUF
in test_loader.py): a tensor-parallel split, and OLMo 3's olmo2 GGUF files."""

from __future__ import annotations

import pytest
import torch

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


def test_an_olmo3_file_is_refused_by_name(tmp_path):
    """llama.cpp writes OLMo 3 (sliding windows on three layers of four) under the olmo2
    architecture: said at once, not served as OLMo 2."""
    from transformers import AutoModelForCausalLM, Olmo3Config

    from minivllm.model.loader import load_hf_config
    from tests.model.test_loader import _write_gguf

    config = Olmo3Config(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=8, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
    )  # fmt: skip
    torch.manual_seed(0)
    state = AutoModelForCausalLM.from_config(config).state_dict()
    path = str(tmp_path / "olmo3.gguf")
    _write_gguf(path, "olmo2", config, state)
    with pytest.raises(NotImplementedError, match="OLMo 3"):
        load_hf_config(path)
