"""Random-weight Hugging Face checkpoints with real models' shapes, for the GPU checks.

The device machine has no hub and no model files, so Qwen3-0.6B's and Llama-3.2-1B's
configs are written out here (their published config.json fields, by hand) and the
weights are drawn at random: every projection and embedding normal with std 0.02 (the
configs' initializer_range), every norm at 1, from a CPU generator seeded per model, so
the same command writes the same weights on any machine. With these the residual stream
is dominated by the layers' outputs, not by the token's own (tied) embedding, so greedy
continuations depend on the whole context and are not a repeated token.

The tokenizer is made here too, not fetched: a word-level vocabulary of exactly the
model's vocab_size ("t0", "t1", ... and the model's special tokens at their real ids),
so every id the model can emit decodes to text. Prompts are token ids anyway.

    python benchmarks/gpu_checkpoints.py qwen3-0.6b llama-3.2-1b --dtype float32
    python benchmarks/gpu_checkpoints.py qwen3-0.6b --dtype bfloat16 --out /tmp/ckpt
    python benchmarks/gpu_checkpoints.py qwen3-0.6b --tiny   # same family, CPU-sized

Each folder is named ``<model>[-tiny]-<dtype>`` under --out and is written once (a
folder holding config.json and model.safetensors is left as it is).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import zlib

DEFAULT_OUT = os.environ.get("MINIVLLM_GPU_CHECKPOINTS", "/tmp/minivllm-gpu-checkpoints")

# Qwen/Qwen3-0.6B's config.json (transformers 4.51 era fields).
QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

# meta-llama/Llama-3.2-1B's config.json.
LLAMA_3_2_1B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 8192,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "num_attention_heads": 32,
    "num_hidden_layers": 16,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 128256,
}

# meta-llama/Llama-3.1-8B's config.json: only for decode rates, with load_format="dummy"
# (write_config: 16 GB of bf16 weights are drawn on the card, not written to its disk).
LLAMA_3_1_8B = {
    **LLAMA_3_2_1B,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "head_dim": 128,
    "num_hidden_layers": 32,
    "rope_scaling": {**LLAMA_3_2_1B["rope_scaling"], "factor": 8.0},
    "tie_word_embeddings": False,
}

MODELS = {"qwen3-0.6b": QWEN3_0_6B, "llama-3.2-1b": LLAMA_3_2_1B, "llama-3.1-8b": LLAMA_3_1_8B}

# The special tokens at their real ids (the rest of each vocabulary is plain words).
SPECIAL_TOKENS = {
    "qwen3": {"bos": "<|endoftext|>", "eos": "<|im_end|>"},
    "llama": {"bos": "<|begin_of_text|>", "eos": "<|end_of_text|>"},
}

# Small enough to run on a CPU in seconds, and keeping what makes each family itself:
# grouped KV heads, Qwen3's head_dim wider than hidden/heads with q/k norms, Llama 3's
# scaled RoPE, tied embeddings. Special ids move inside the smaller vocabulary.
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 2048,
    "max_window_layers": 2,
    "bos_token_id": 2046,
    "eos_token_id": 2047,
    # A wider draw: at std 0.02 two layers of width 64 barely move the residual stream
    # and greedy outputs repeat one token; at 0.2 they vary as the full models' do.
    "initializer_range": 0.2,
}


def model_config(name: str, tiny: bool = False) -> dict:
    """The config.json fields of ``name`` (a key of MODELS), or its CPU-sized variant."""
    config = copy.deepcopy(MODELS[name])
    if tiny:
        config.update({k: v for k, v in TINY.items() if k in config})
    return config


def checkpoint_dir(name: str, dtype: str, out: str = DEFAULT_OUT, tiny: bool = False) -> str:
    return os.path.join(out, f"{name}{'-tiny' if tiny else ''}-{dtype}")


def weight_bytes(config: dict, dtype_bytes: int) -> int:
    """Bytes of the weights one decode step reads (tied embeddings counted once as the LM
    head; the embedding rows a step gathers are negligible)."""
    h, i, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i
    lm_head = config["vocab_size"] * h
    return (layers * per_layer + lm_head) * dtype_bytes


def kv_bytes_per_token(config: dict, dtype_bytes: int) -> int:
    return (
        2
        * config["num_hidden_layers"]
        * config["num_key_value_heads"]
        * config["head_dim"]
        * dtype_bytes
    )


def write_tokenizer(config: dict, folder: str) -> None:
    """A word-level tokenizer covering exactly the model's vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = SPECIAL_TOKENS[config["model_type"]]
    ids = {special["bos"]: config["bos_token_id"], special["eos"]: config["eos_token_id"]}
    vocab = {f"t{i}": i for i in range(config["vocab_size"])}
    for token, token_id in ids.items():
        del vocab[f"t{token_id}"]
        vocab[token] = token_id
    backend = Tokenizer(models.WordLevel(vocab, unk_token=special["bos"]))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=special["bos"], eos_token=special["eos"]
    )
    tokenizer.save_pretrained(folder)


def write_config(name: str, dtype: str, out: str = DEFAULT_OUT, tiny: bool = False) -> str:
    """A folder with only ``name``'s config.json and tokenizer: for load_format="dummy"."""
    folder = checkpoint_dir(name, dtype, out, tiny) + "-config"
    if os.path.exists(os.path.join(folder, "tokenizer.json")):
        return folder
    fields = model_config(name, tiny)
    fields["torch_dtype"] = dtype
    tmp = folder + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(fields, f, indent=1)
    write_tokenizer(fields, tmp)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    return folder


def write_checkpoint(
    name: str, dtype: str = "float32", out: str = DEFAULT_OUT, tiny: bool = False
) -> str:
    """Write (once) the random-weight checkpoint of ``name`` in ``dtype``; return its folder."""
    folder = checkpoint_dir(name, dtype, out, tiny)
    if all(os.path.exists(os.path.join(folder, f)) for f in ("config.json", "tokenizer.json")):
        return folder
    import torch
    import transformers

    fields = model_config(name, tiny)
    fields["torch_dtype"] = dtype
    config = transformers.AutoConfig.for_model(**fields)
    cls = getattr(transformers, fields["architectures"][0])
    with torch.device("meta"):
        model = cls(config)
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    std = fields["initializer_range"]
    state = {}
    for key, param in model.state_dict().items():
        if key == "lm_head.weight" and fields["tie_word_embeddings"]:
            continue  # the embedding, tied below
        if "norm" in key:
            value = torch.ones(param.shape)
        else:
            value = torch.empty(param.shape).normal_(0.0, std, generator=generator)
        state[key] = value.to(getattr(torch, dtype))
    missing, unexpected = model.load_state_dict(state, assign=True, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    # Written beside the target and renamed, so a folder that exists is whole.
    tmp = folder + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    write_tokenizer(fields, tmp)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", choices=sorted(MODELS))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument("--tiny", action="store_true", help="the CPU-sized variant")
    args = parser.parse_args()
    for name in args.models:
        folder = write_checkpoint(name, args.dtype, args.out, args.tiny)
        with open(os.path.join(folder, "config.json")) as f:
            config = json.load(f)
        print(folder, f"{config['num_hidden_layers']} layers, hidden {config['hidden_size']}")


if __name__ == "__main__":
    main()
