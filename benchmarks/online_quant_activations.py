"""Where q8_0's int8 activations cost perplexity (issue 49, acceptance 4): the online q8_0
model of the bundled SmolLM2's float32 directory with the layers whose name matches each
--float-acts pattern run on float activations (their Q8_0 weights dequantized, F.linear:
the same weights, only the activations' rounding gone), scored as online_quant_quality.py
does (perplexity on issue 15's text against float32). "none" is q8_0 as it runs; "." every
layer on float activations (the weights' error alone). Not a timing benchmark.

--outlier-blocks N simulates the fix that --blocks points at: the matching layers run int8
activations rounded in torch as the kernels round them (per 32 values, max|x| / 127) but for
the N blocks of each layer's input that held the most rounding error on a calibration prompt
(the 512 tokens after the scored ones), which stay float; N = 0 is the simulation's control.

--residual-pass N runs the matching layers through the real q8_0 kernel twice in one call:
the rows x and, stacked under them, their int8 rounding error r = x - dx * xq (rounded in
torch exactly as the kernel rounds: per 32 values, max|x| / 127, half to even), summed.
That is what a kernel with a second int8 pass gives (the weights read once; 2x its integer
work), to ~2^-14 of each block's max|x|: float activations on the same weights, by the
kernels' own arithmetic. N = "all" passes every block's error; N = 1, 2, ... only each
row's N blocks of largest max|x| (no calibration: the outlier channel's block, chosen per
row as a kernel would), the cheap fix: a second pass over N/(k/32) of the layer's work.

--blocks also reports, from HF transformers' float32 forward of the first 512 tokens, each
layer input's share of the squared int8 rounding error (per 32 values, max|x| / 127, as the
kernels quantize) that its costliest 32-value block holds: where one block holds most of it
(an outlier channel), rounding that block finer would cost a small part of a second pass.

    .venv/bin/python benchmarks/online_quant_activations.py                   # 20,480 tokens
    .venv/bin/python benchmarks/online_quant_activations.py --float-acts lm_head --blocks
    .venv/bin/python benchmarks/online_quant_activations.py \
        --float-acts 'lm_head|qkv_proj|gate_up_proj' --outlier-blocks 0,1
    .venv/bin/python benchmarks/online_quant_activations.py \
        --float-acts 'lm_head|qkv_proj|gate_up_proj,.' --residual-pass 1,all
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys

sys.path.insert(0, os.path.dirname(__file__))
from gguf_perplexity import fixed_text, score  # noqa: E402

DEFAULT_PATTERNS = "none,lm_head,qkv_proj,o_proj,gate_up_proj,down_proj,lm_head|down_proj,."


def float_activations_for(pattern: list[str | None], state: dict) -> None:
    """Layers whose prefix matches pattern[0] get float activations on their q8_0 weights
    (state["outlier_blocks"] None), or int8 ones but for their costliest blocks (an int:
    how many; chosen from what they saw while state["calibrating"])."""
    import torch
    import torch.nn.functional as F

    from minivllm.model.layers.quantization import online
    from minivllm.model.layers.quantization.base import quantized_weight

    def int8_rounded(x: torch.Tensor) -> torch.Tensor:
        blocks = x.reshape(x.shape[0], -1, 32)
        d = blocks.abs().amax(-1, keepdim=True) / 127
        inverse = torch.where(d == 0, 0, 1 / d)
        return (torch.round(blocks * inverse) * d).reshape(x.shape)

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
            x = x.float()
            count = state["outlier_blocks"]
            if count is None:
                return F.linear(x, layer.float_weight, bias)
            flat = x.reshape(-1, x.shape[-1])
            rounded = int8_rounded(flat)
            if state["calibrating"]:
                error = ((rounded - flat) ** 2).reshape(flat.shape[0], -1, 32).sum((0, 2))
                layer.block_error = getattr(layer, "block_error", 0) + error
                layer.keep = None
            elif getattr(layer, "keep", None) is None:
                layer.keep = torch.zeros(flat.shape[1], dtype=torch.bool)
                for block in torch.argsort(layer.block_error, descending=True)[:count]:
                    layer.keep[32 * block : 32 * block + 32] = True
            if not state["calibrating"]:
                rounded = torch.where(layer.keep, flat, rounded)
            return F.linear(rounded.reshape(x.shape), layer.float_weight, bias)

    class ResidualPass(online.OnlineQuantLinearMethod):
        def apply(self, layer, x, bias=None):
            flat = x.reshape(-1, x.shape[-1]).float().contiguous()
            m = flat.shape[0]
            blocks = flat.view(m, -1, 32)
            amax = blocks.abs().amax(-1, keepdim=True)
            d = amax / 127
            inverse = torch.where(d == 0, 0, 1 / d)
            error = blocks - torch.round(blocks * inverse) * d
            count = state["residual_pass"]
            if count != "all":
                top = torch.topk(amax.squeeze(-1), min(int(count), blocks.shape[1]), dim=-1)
                keep = torch.zeros_like(amax.squeeze(-1), dtype=torch.bool)
                keep.scatter_(1, top.indices, True)
                error = error * keep.unsqueeze(-1)
            stacked = torch.cat([flat, error.reshape(m, -1)])
            y = super().apply(layer, stacked)
            y = y[:m] + y[m:]
            if bias is not None:
                y = y + bias
            return y.reshape(*x.shape[:-1], y.shape[-1])

    method_for = online.OnlineQuantConfig.get_quant_method

    def get_quant_method(self, layer, prefix):
        method = method_for(self, layer, prefix)
        if isinstance(method, online.OnlineQuantLinearMethod) and pattern[0]:
            if re.search(pattern[0], prefix):
                if state.get("residual_pass") is not None:
                    return ResidualPass(method.type_name)
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
    parser.add_argument("--outlier-blocks", default=None, help="e.g. 0,1 (see above)")
    parser.add_argument("--residual-pass", default=None, help="e.g. 1,all (see above)")
    args = parser.parse_args()

    from prepare_model import prepare

    from minivllm.tokenizer import load_tokenizer

    path = args.model or prepare()
    all_ids = load_tokenizer(path).encode(fixed_text())
    ids, ids_after = all_ids[: args.num_tokens], all_ids[args.num_tokens :]
    if args.blocks:
        print(json.dumps({"costliest_block_share": block_shares(path, ids)}, indent=1))
    chunks = [ids[i : i + args.chunk] for i in range(0, len(ids), args.chunk)]
    chunks = [c for c in chunks if len(c) > 1]
    pattern: list[str | None] = [None]
    state = {"outlier_blocks": None, "calibrating": False, "residual_pass": None}
    float_activations_for(pattern, state)
    dense = score("none", chunks, path)
    print(json.dumps({"perplexity_float32": dense["perplexity"]}), flush=True)
    counts = [None] if args.outlier_blocks is None else args.outlier_blocks.split(",")
    passes = [None] if args.residual_pass is None else args.residual_pass.split(",")
    for name in args.float_acts.split(","):
        for count, residual in [(c, r) for c in counts for r in passes]:
            pattern[0] = None if name == "none" else name
            state["outlier_blocks"] = None if count is None else int(count)
            state["residual_pass"] = residual
            calibration = ids_after[:512] if count is not None else None
            quant = score_q8_0(chunks, path, calibration, state)
            agree = sum(a == b for a, b in zip(dense["top1"], quant["top1"], strict=True))
            row = {
                "float_activations": name,
                "outlier_blocks": state["outlier_blocks"],
                "residual_pass": residual,
                "perplexity_q8_0": quant["perplexity"],
                "vs_float32_pct": 100 * (quant["perplexity"] / dense["perplexity"] - 1),
                "top1_agreement": agree / len(dense["top1"]),
            }
            print(json.dumps(row), flush=True)


def score_q8_0(chunks, path: str, calibration: list[int] | None, state: dict) -> dict:
    """gguf_perplexity.score of q8_0, after a calibration prompt where one is given."""
    if calibration is None:
        return score("q8_0", chunks, path)
    from minivllm import LLM, SamplingParams

    llm = LLM(
        model=path,
        quantization="q8_0",
        enable_multiprocessing=False,
        enable_prefix_caching=False,
        enforce_eager=True,
        max_model_len=max(len(c) for c in chunks) + 8,
    )
    state["calibrating"] = True
    llm.generate([{"prompt_token_ids": calibration}], SamplingParams(max_tokens=1))
    state["calibrating"] = False
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    outputs = llm.generate([{"prompt_token_ids": c} for c in chunks], params)
    nll, count, top1 = 0.0, 0, []
    for chunk, out in zip(chunks, outputs, strict=True):
        for token, position in zip(chunk[1:], out.prompt_logprobs[1:], strict=True):
            nll -= position[token].logprob
            count += 1
            top1.append(next(t for t, lp in position.items() if lp.rank == 1))
    return {"perplexity": math.exp(nll / count), "tokens": count, "top1": top1}


if __name__ == "__main__":
    main()
