"""Shared fixtures: the bundled real model, and tiny random-weight checkpoints on disk."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("MINIVLLM_CPU_KVCACHE_SPACE", "0.25")  # keep test engines small
# minivllm's records reach pytest's caplog through the root logger (tests/test_logger.py
# checks the configuration that `import minivllm` does by default, in subprocesses).
os.environ.setdefault("MINIVLLM_CONFIGURE_LOGGING", "0")
# Tests compare an engine's outputs with another engine's on the same machine: both keep one
# thread per core, whatever else the (shared, busy) machine runs.
os.environ.setdefault("MINIVLLM_CPU_THREADS_FOLLOW_LOAD", "0")


def pytest_configure(config) -> None:
    """The suite is written for the CPU (float32 engines against HF references on the CPU;
    device "auto" would pick CUDA on a machine with a GPU, and bfloat16 with it). Unless the
    run selects the tests marked gpu (`make test-gpu`), CUDA is hidden: from this process
    and from the engine and server processes the tests start, which inherit it."""
    markexpr = config.getoption("markexpr") or ""
    if "gpu" not in markexpr.replace("not gpu", ""):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch

    if not torch.cuda.is_available():
        # Triton's kernels run interpreted on the CPU. Set before any test imports them:
        # a module that sets it itself is too late once another has (pytest tests/model
        # tests/worker failed the Triton engine tests that way).
        os.environ.setdefault("TRITON_INTERPRET", "1")
    _cache_gguf_parsing()


def _cache_gguf_parsing() -> None:
    """transformers' GGUF loading, our reference, parses a file's whole header (SmolLM2's
    49k-token vocab) once for the config, again for the tokenizer and the weights, and builds
    gguf's tensor-name map once per tensor: ~30 s per load on this machine, paid by each
    test module that loads the bundled model through transformers. Within this process the
    parse of one unchanged file and the name map for one architecture are kept (both are
    read-only; minivllm reads GGUF files with its own reader). The engine and server
    processes the tests start are untouched."""
    import functools

    import gguf

    reader_class = gguf.GGUFReader

    @functools.lru_cache(maxsize=8)
    def parsed(path: str, version: tuple[int, int, int]) -> gguf.GGUFReader:
        return reader_class(path)

    def cached_reader(path, mode: str = "r") -> gguf.GGUFReader:
        if mode != "r":
            return reader_class(path, mode)
        stat = os.stat(path)
        return parsed(os.path.realpath(path), (stat.st_ino, stat.st_size, stat.st_mtime_ns))

    gguf.GGUFReader = cached_reader
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map)


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


# Llama checkpoints with each RoPE scaling; their trained context (32 positions) is shorter
# than the tests' generations, so the scaled frequencies are exercised.
ROPE_SCALED_ARCHS = {
    "llama-linear": {"rope_type": "linear", "factor": 4.0},
    "llama-dynamic": {"rope_type": "dynamic", "factor": 4.0},
    "llama-yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
}
# Architectures beyond the Llama family, with the options that change their computation.
OTHER_ARCHS = (
    "opt",
    "opt-post-norm",
    "gemma3",
    "gemma3-softcap",
    "gemma3-mm",
    "gemma2",
    "mistral",
    "smollm3",
    "granite",
    "olmo2",
    "olmo3",
    "glm4",
    "ernie4_5",
    "phi3",
    "phi3-longrope",
    "phi4-mini",
    "gemma4",
    "gemma4-moe",
)
# Qwen3-MoE: 8 experts, 2 a token. "qwen3-moe": layer 1 of 3 dense (mlp_only_layers), the
# chosen scores renormalised (as real Qwen3-MoE configs and llama.cpp do); "qwen3-moe-step":
# every second layer sparse (decoder_sparse_step), the scores as the softmax gives them.
# Mixtral: 4 experts, 2 a token, a window of 12 tokens. "qwen2-moe": as "qwen3-moe" with
# q/k/v biases for q/k norms and a gated shared expert, the scores not renormalised.
# "olmoe": 8 experts, 2 a token, in every layer; q/k norms over the whole projection;
# "olmoe-clip": q, k and v clamped to [-2, 2] (clip_qkv).
# "granite-moe": Granite's scales with 4 experts, 2 a token, renormalised, in every layer.
# "gpt-oss": attention sinks, alternating windows, biased experts with clamped SwiGLU.
MOE_ARCHS = (
    "qwen3-moe", "qwen3-moe-step", "mixtral", "qwen2-moe", "olmoe", "olmoe-clip", "granite-moe",
    "gpt-oss",
)  # fmt: skip


# Granite's four scales away from 1 (and from 1/sqrt(head_dim)), as real Granite configs.
GRANITE_SCALES = dict(
    embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.1, logits_scaling=2.0
)


def write_tiny_checkpoint(arch: str, folder: str, tokenizer, **sizes) -> str:
    """A small random-weight HF checkpoint (safetensors + config + tokenizer) in folder;
    ``sizes`` override its config's (e.g. hidden_size=256 for 256-weight GGUF blocks).

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
    common.update(sizes)
    if arch == "llama":
        config = transformers.LlamaConfig(tie_word_embeddings=False, **common)
        cls = transformers.LlamaForCausalLM
    elif arch in ROPE_SCALED_ARCHS:
        rope = {"rope_theta": 10000.0, **ROPE_SCALED_ARCHS[arch]}
        trained = 512 if arch == "llama3" else 32  # llama3 names the stretched length
        common.update(max_position_embeddings=trained)
        config = transformers.LlamaConfig(tie_word_embeddings=False, rope_parameters=rope, **common)
        cls = transformers.LlamaForCausalLM
    elif arch == "qwen2":
        config = transformers.Qwen2Config(tie_word_embeddings=True, **common)
        cls = transformers.Qwen2ForCausalLM
    elif arch == "qwen3":
        config = transformers.Qwen3Config(tie_word_embeddings=False, head_dim=32, **common)
        cls = transformers.Qwen3ForCausalLM
    elif arch in ("opt", "opt-post-norm"):
        config = transformers.OPTConfig(
            vocab_size=len(tokenizer),
            hidden_size=64,
            ffn_dim=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=512,
            # opt-350m: a smaller embedding projected in and out, norms after the residual.
            word_embed_proj_dim=32 if arch == "opt-post-norm" else 64,
            do_layer_norm_before=arch == "opt",
            init_std=0.3,
            pad_token_id=tokenizer.pad_token_id or 0,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        cls = transformers.OPTForCausalLM
    elif arch in ("gemma3", "gemma3-softcap", "gemma3-mm"):
        softcap = arch == "gemma3-softcap"
        config = transformers.Gemma3TextConfig(
            **{**common, "num_hidden_layers": 4},
            head_dim=32,
            # Sliding layers see 8 tokens: far fewer than the tests' sequences.
            sliding_window=8,
            layer_types=[
                "sliding_attention",
                "full_attention",
                "sliding_attention",
                "sliding_attention",
            ],
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
            query_pre_attn_scalar=24,  # not head_dim: the scale must come from the config
            attn_logit_softcapping=20.0 if softcap else None,
            final_logit_softcapping=15.0 if softcap else None,
            pad_token_id=tokenizer.pad_token_id or 0,
            tie_word_embeddings=True,
        )
        cls = transformers.Gemma3ForCausalLM
        if arch == "gemma3-mm":  # Gemma 3 4B and up: text and images, a tiny SigLIP tower
            vision = transformers.SiglipVisionConfig(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=2,
                image_size=28,
                patch_size=14,
            )
            config = transformers.Gemma3Config(
                text_config=config.to_dict(),
                vision_config=vision.to_dict(),
                mm_tokens_per_image=4,
            )
            cls = transformers.Gemma3ForConditionalGeneration
    elif arch == "gemma2":
        config = transformers.Gemma2Config(
            **{**common, "num_hidden_layers": 4},
            head_dim=32,
            sliding_window=8,  # layers 0 and 2 see 8 tokens, 1 and 3 all of them
            rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
            query_pre_attn_scalar=24,
            # Low caps, so that both bend the scores and logits of these peaked weights.
            attn_logit_softcapping=5.0,
            final_logit_softcapping=15.0,
            pad_token_id=tokenizer.pad_token_id or 0,
            tie_word_embeddings=True,
        )
        cls = transformers.Gemma2ForCausalLM
    elif arch == "smollm3":
        # 4 layers: RoPE in the first three, none in the fourth (no_rope_layers 1, 1, 1, 0).
        config = transformers.SmolLM3Config(
            tie_word_embeddings=True,
            pad_token_id=tokenizer.pad_token_id or 0,  # its default is Llama 3's
            **{**common, "num_hidden_layers": 4},
        )
        assert config.no_rope_layers == [1, 1, 1, 0]
        cls = transformers.SmolLM3ForCausalLM
    elif arch == "granite":
        config = transformers.GraniteConfig(tie_word_embeddings=True, **GRANITE_SCALES, **common)
        cls = transformers.GraniteForCausalLM
    elif arch == "granite-moe":
        # 4 experts, 2 a token, in every layer; Granite's scales away from 1.
        config = transformers.GraniteMoeConfig(
            tie_word_embeddings=True,
            num_local_experts=4,
            num_experts_per_tok=2,
            **GRANITE_SCALES,
            **common,
        )
        cls = transformers.GraniteMoeForCausalLM
    elif arch == "olmo2":
        config = transformers.Olmo2Config(tie_word_embeddings=False, pad_token_id=0, **common)
        cls = transformers.Olmo2ForCausalLM
    elif arch == "olmo3":
        # Layers 0-2 see 8 tokens, layer 3 all of them with YaRN stretching a trained
        # context of 32 positions; the windowed layers rotate with another base, unscaled.
        config = transformers.Olmo3Config(
            tie_word_embeddings=False,
            pad_token_id=0,
            sliding_window=8,
            rope_parameters={
                "full_attention": {
                    "rope_type": "yarn",
                    "rope_theta": 500000.0,
                    "factor": 4.0,
                    "original_max_position_embeddings": 32,
                },
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
            **{**common, "num_hidden_layers": 4},
        )
        assert config.layer_types[2:] == ["sliding_attention", "full_attention"]
        cls = transformers.Olmo3ForCausalLM
    elif arch == "glm4":
        # q/k/v biases; RoPE on the first half of each head, in interleaved pairs.
        config = transformers.Glm4Config(
            tie_word_embeddings=False, pad_token_id=0, head_dim=32, **common
        )
        assert config.rope_parameters["partial_rotary_factor"] == 0.5 and config.attention_bias
        cls = transformers.Glm4ForCausalLM
    elif arch == "ernie4_5":
        # RoPE in interleaved pairs over whole heads; the LM head tied, as the 0.3B model.
        config = transformers.Ernie4_5Config(
            tie_word_embeddings=True, pad_token_id=0, head_dim=16, **common
        )
        cls = transformers.Ernie4_5ForCausalLM
    elif arch == "mistral":
        # Every layer sees 8 tokens (Mistral v0.1 has 4096): fewer than the tests' sequences.
        config = transformers.MistralConfig(tie_word_embeddings=False, sliding_window=8, **common)
        cls = transformers.MistralForCausalLM
    elif arch == "phi3":
        # Fused qkv_proj / gate_up_proj in the checkpoint; a window as Phi-3-mini-4k's (2047).
        config = transformers.Phi3Config(
            tie_word_embeddings=False, sliding_window=12, pad_token_id=0, **common
        )
        cls = transformers.Phi3ForCausalLM
    elif arch.startswith("qwen3-moe"):
        step = arch == "qwen3-moe-step"
        config = transformers.Qwen3MoeConfig(
            **{**common, "num_hidden_layers": 4 if step else 3},
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=not step,
            decoder_sparse_step=2 if step else 1,
            mlp_only_layers=[] if step else [1],
            tie_word_embeddings=False,
        )
        cls = transformers.Qwen3MoeForCausalLM
    elif arch in ("phi3-longrope", "phi4-mini"):
        # LongRoPE as Phi-3.5 (no window): the short factors for the first 80 positions (the
        # tests' sequences), cos/sin times sqrt(1 + ln(512 / 80) / ln 80). Phi-4 mini also
        # rotates only the first 3/4 of each head (12 of 16 dimensions: 6 factors), and its
        # LM head is the embedding.
        rope = {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0, 1.02, 1.05, 1.1, 1.2, 1.3, 1.5, 2.0],
            "long_factor": [1.0, 1.5, 2.0, 3.0, 5.0, 8.0, 12.0, 16.0],
        }
        if arch == "phi4-mini":
            rope["partial_rotary_factor"] = 0.75
            rope["short_factor"] = rope["short_factor"][2:]
            rope["long_factor"] = rope["long_factor"][2:]
        config = transformers.Phi3Config(
            tie_word_embeddings=arch == "phi4-mini",  # as the real Phi-4 mini
            original_max_position_embeddings=80,
            rope_parameters=rope,
            pad_token_id=0,
            **common,
        )
        cls = transformers.Phi3ForCausalLM
    elif arch == "qwen2-moe":
        config = transformers.Qwen2MoeConfig(
            **{**common, "num_hidden_layers": 3},
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            norm_topk_prob=False,
            mlp_only_layers=[1],
            tie_word_embeddings=False,
        )
        cls = transformers.Qwen2MoeForCausalLM
    elif arch.startswith("olmoe"):
        config = transformers.OlmoeConfig(
            **{**common, "intermediate_size": 32},
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            clip_qkv=2.0 if arch == "olmoe-clip" else None,
            tie_word_embeddings=False,
        )
        cls = transformers.OlmoeForCausalLM
    elif arch == "gpt-oss":
        # 4 experts, 2 a token; sliding layers (0 and 2) see 8 tokens; YaRN stretching a
        # trained context of 32 positions; sinks random, as the other weights.
        config = transformers.GptOssConfig(
            **{**common, "num_hidden_layers": 3, "intermediate_size": 32},
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 32,
            },
            tie_word_embeddings=False,
        )
        cls = transformers.GptOssForCausalLM
    elif arch in ("gemma4", "gemma4-moe"):
        # Six layers: sliding ones see 8 tokens; the global ones (2 and 5) have their own
        # head size and one KV head, turn a quarter of each head (proportional RoPE) and take
        # their values from the key projection. "gemma4" (E2B's kind): per-layer
        # embeddings, the last two layers attend over layers 3's and 2's K/V with MLPs twice
        # as wide. "gemma4-moe" (26B-A4B's kind): 4 experts, 2 a token, beside every MLP.
        moe = arch == "gemma4-moe"
        config = transformers.Gemma4TextConfig(
            **{**common, "num_hidden_layers": 6},
            head_dim=32,
            global_head_dim=64,
            num_global_key_value_heads=1,
            attention_k_eq_v=True,
            sliding_window=8,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
            num_kv_shared_layers=0 if moe else 2,
            use_double_wide_mlp=True,
            hidden_size_per_layer_input=0 if moe else 16,
            vocab_size_per_layer_input=len(tokenizer),
            enable_moe_block=moe,
            num_experts=4 if moe else None,
            top_k_experts=2 if moe else None,
            moe_intermediate_size=32 if moe else None,
            final_logit_softcapping=15.0,
            pad_token_id=tokenizer.pad_token_id or 0,
            # Untied: a tiny tied model repeats its last token, which proves little.
            tie_word_embeddings=False,
        )
        cls = transformers.Gemma4ForCausalLM
    elif arch == "mixtral":
        config = transformers.MixtralConfig(
            **{**common, "intermediate_size": 32},
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=12,
            tie_word_embeddings=False,
        )
        cls = transformers.MixtralForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(0)
    model = cls(config).to(torch.float32).eval()
    if arch in OTHER_ARCHS or arch in MOE_ARCHS:
        with torch.no_grad():
            for name, param in model.named_parameters():
                # HF initialises norms to the identity: random ones prove they are loaded.
                if "norm" in name:
                    param.add_(torch.randn_like(param) * 0.2)
                # gpt-oss's and GLM-4's biases (and sinks) start at zero: random ones prove
                # them too (GLM-4's q/k biases are reordered with their rows).
                if arch in ("gpt-oss", "glm4") and ("bias" in name or "sinks" in name):
                    param.add_(torch.randn_like(param))
                # Gemma 4's router scales start at one.
                if "scale" in name:
                    param.add_(torch.randn_like(param) * 0.2)
            for name, buffer in model.named_buffers():
                if name.endswith("layer_scalar"):  # Gemma 4's, saved though a buffer
                    buffer.add_(torch.randn_like(buffer) * 0.2)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session", params=TINY_ARCHS)
def tiny_model(request, tmp_path_factory, smollm2_tokenizer) -> str:
    folder = tmp_path_factory.mktemp(f"tiny-{request.param}")
    return write_tiny_checkpoint(request.param, str(folder), smollm2_tokenizer)


@pytest.fixture(scope="session")
def tiny_opt(tmp_path_factory, smollm2_tokenizer) -> str:
    """A tiny random OPT checkpoint: the stand-in for the seeds' facebook/opt-125m."""
    folder = tmp_path_factory.mktemp("tiny-opt")
    return write_tiny_checkpoint("opt", str(folder), smollm2_tokenizer)
