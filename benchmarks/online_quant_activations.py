"""Where q8_0's int8 activations cost perplexity (issue 49, acceptance 4): the online q8_0
model of the bundled SmolLM2's float32 directory with the layers whose name matches each
--float-acts pattern run on float activations (their Q8_0 weights dequantized, F.linear:
the same weights, only the activations' rounding gone), scored as online_quant_quality.py
does (perplexity on issue 15's text against float32). "none" is q8_0 as it runs; "." every
layer on float activations (the weights' error alone). Not a timing benchmark.

--blocks also reports, from HF transformers' float32 forward of the first 512 tokens, each
layer input's share of the squared int8 rounding error (per 32 values, max|x| / 127, as the
kernels quantize) that its costliest 32-value block holds: where one block holds most of it
(an outlier channel), rounding that block finer would cost a small part of a second pass.

    .venv/bin/python benchmarks/online_quant_activations.py                   # 20,480 tokens
    .venv/bin/python benchmarks/online_quant_activations.py --float-acts lm_head --blocks
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(__file__))
from gguf_perplexity import fixed_text, score  # noqa: E402

DEFAULT_PATTERNS = "none,lm_head,qkv_proj,o_proj,gate_up_proj,down_proj,lm_head|down_proj,."


def float_activations_for(pattern: list[str | None]) -> None:
    """Layers whose prefix matches pattern[0] get float activations on their q8_0 weights."""
    import torch
    import torch.nn.functional as F

    from minivllm.model.layers.quantization import online
    from minivllm.model.layers.quantization.base import quantized_weight

    class FloatActivations(online.OnlineQuantLinearMethod):
        def process_weights_after_loading(self, layer) -> None:
            super().process_weights_after_loading(layer)
            weight = quantized_weight(layer.weight)
            full = torch.empty(weight.out_features, weight.in_features)
            for offset, tensor in weight.segments:
                full[offset : offset + tensor.shape[0]] = tensor.dequantize()
            for offset, dense in weight.dense:
                full[offset : offset + dense.shape[0]] = dense
            layer.float_weight = full

        def apply(self, layer, x, bias=None):
            return F.linear(x.float(), layer.float_weight, bias)

    method_for = online.OnlineQuantConfig.get_quant_method

    def get_quant_method(self, layer, prefix):
        method = method_for(self, layer, prefix)
        if isinstance(method, online.OnlineQuantLinearMethod) and pattern[0]:
            if re.search(pattern[0], prefix):
                return FloatActivations(method.type_name)
        return method

    online.OnlineQuantConfig.get_quant_method = get_quant_method


def block_shares(path: str, ids: list[int]) -> dict[str, float]:
    """Each linear input's share of its int8 rounding error held by its costliest block."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    shares: dict[str, float] = {}

    def hook(name):
        def record(module, inputs):
            x = inputs[0].detach().reshape(-1, 32)
            d = x.abs().amax(-1, keepdim=True) / 127
            error = (x - torch.round(x / torch.where(d == 0, 1, d)) * d) ** 2
            per_block = error.reshape(-1, inputs[0].shape[-1] // 32, 32).sum((0, 2))
            shares[name] = float(per_block.max() / per_block.sum())

        return record

    for name, module in model.named_modules():
        if name.endswith(("q_proj", "o_proj", "gate_proj", "down_proj", "lm_head")):
            module.register_forward_pre_hook(hook(name))
    with torch.no_grad():
        model(torch.tensor([ids[:512]]))
    return shares


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="a float HF directory (default: prepared)")
    parser.add_argument("--float-acts", default=DEFAULT_PATTERNS, help="comma-separated regexes")
    parser.add_argument("--num-tokens", type=int, default=20480)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--blocks", action="store_true")
    args = parser.parse_args()

    from prepare_model import prepare

    from minivllm.tokenizer import load_tokenizer

    path = args.model or prepare()
    ids = load_tokenizer(path).encode(fixed_text())[: args.num_tokens]
    if args.blocks:
        print(json.dumps({"costliest_block_share": block_shares(path, ids)}, indent=1))
    chunks = [ids[i : i + args.chunk] for i in range(0, len(ids), args.chunk)]
    chunks = [c for c in chunks if len(c) > 1]
    pattern: list[str | None] = [None]
    float_activations_for(pattern)
    dense = score("none", chunks, path)
    print(json.dumps({"perplexity_float32": dense["perplexity"]}), flush=True)
    for name in args.float_acts.split(","):
        pattern[0] = None if name == "none" else name
        quant = score("q8_0", chunks, path)
        agree = sum(a == b for a, b in zip(dense["top1"], quant["top1"], strict=True))
        row = {
            "float_activations": name,
            "perplexity_q8_0": quant["perplexity"],
            "vs_float32_pct": 100 * (quant["perplexity"] / dense["perplexity"] - 1),
            "top1_agreement": agree / len(dense["top1"]),
        }
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
