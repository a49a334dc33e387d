"""Shared fixtures: the bundled real model, and tiny random-weight checkpoints on disk."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("MINIVLLM_CPU_KVCACHE_SPACE", "0.25")  # keep test engines small

TINY_ARCHS = ("llama", "qwen2", "qwen3")


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from minivllm.model.loader import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path):
    from minivllm.tokenizer import load_tokenizer

    return load_tokenizer(smollm2_path)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path):
    """The reference: transformers' own GGUF loading of the bundled model (slow: ~30 s)."""
    import torch
    import transformers

    folder, name = os.path.split(smollm2_path)
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32
    ).eval()


def write_tiny_checkpoint(arch: str, folder: str, tokenizer) -> str:
    """A small random-weight HF checkpoint (safetensors + config + tokenizer) in folder.

    The weights are drawn with a large std so the logits are peaked: greedy choices then
    do not hinge on rounding differences between implementations.
    """
    import torch
    import transformers

    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        initializer_range=0.3,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    if arch == "llama":
        config = transformers.LlamaConfig(tie_word_embeddings=False, **common)
        cls = transformers.LlamaForCausalLM
    elif arch == "qwen2":
        config = transformers.Qwen2Config(tie_word_embeddings=True, **common)
        cls = transformers.Qwen2ForCausalLM
    elif arch == "qwen3":
        config = transformers.Qwen3Config(tie_word_embeddings=False, head_dim=32, **common)
        cls = transformers.Qwen3ForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(0)
    model = cls(config).to(torch.float32).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session", params=TINY_ARCHS)
def tiny_model(request, tmp_path_factory, smollm2_tokenizer) -> str:
    folder = tmp_path_factory.mktemp(f"tiny-{request.param}")
    return write_tiny_checkpoint(request.param, str(folder), smollm2_tokenizer)
