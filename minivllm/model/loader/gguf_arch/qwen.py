"""Qwen2, Qwen3 and their mixtures of experts (HF's layout: no q/k permutation; qwen2
always has q/k/v biases, qwen3 never)."""

from __future__ import annotations

from typing import Any

from minivllm.model.loader.gguf_arch.base import GGUFArch, GGUFMeta


def sparse_moe_fields(
    meta: GGUFMeta, kwargs: dict[str, Any], norm_topk_prob: bool
) -> dict[str, Any]:
    """The experts' fields under Qwen2/3-MoE's names (OLMoE's too): a layer without a
    router is a dense one. norm_topk_prob: whether llama.cpp renormalises the chosen
    experts' weights when the file does not say (its qwen3moe does: HF's norm_topk_prob,
    which real Qwen3-MoE configs set; its qwen2moe does not)."""
    shapes = meta.shapes
    layers = range(kwargs["num_hidden_layers"])
    dense = [i for i in layers if f"blk.{i}.ffn_gate_inp.weight" not in shapes]
    first_sparse = next(i for i in layers if i not in dense)
    return {
        "num_experts": int(meta.get("expert_count")),
        "num_experts_per_tok": int(meta.get("expert_used_count")),
        "moe_intermediate_size": int(
            meta.get(
                "expert_feed_forward_length",
                shapes[f"blk.{first_sparse}.ffn_gate_exps.weight"][1],
            )
        ),
        "norm_topk_prob": bool(meta.get("expert_weights_norm", norm_topk_prob)),
        "decoder_sparse_step": 1,
        "mlp_only_layers": dense,
    }


def _qwen2moe(meta: GGUFMeta, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Qwen2-MoE adds a shared expert."""
    fields = sparse_moe_fields(meta, kwargs, norm_topk_prob=False)
    first_sparse = next(
        i for i in range(kwargs["num_hidden_layers"]) if i not in fields["mlp_only_layers"]
    )
    rows = meta.shapes[f"blk.{first_sparse}.ffn_gate_shexp.weight"][0]
    shared = int(meta.get("expert_shared_feed_forward_length", rows))
    return {"shared_expert_intermediate_size": shared, **fields}


def _qwen3moe(meta: GGUFMeta, kwargs: dict[str, Any]) -> dict[str, Any]:
    return sparse_moe_fields(meta, kwargs, norm_topk_prob=True)


ARCHITECTURES = [
    GGUFArch("qwen2", "Qwen2ForCausalLM"),
    GGUFArch("qwen3", "Qwen3ForCausalLM"),
    GGUFArch("qwen2moe", "Qwen2MoeForCausalLM", model_type="qwen2_moe", config=_qwen2moe),
    GGUFArch("qwen3moe", "Qwen3MoeForCausalLM", model_type="qwen3_moe", config=_qwen3moe),
]
