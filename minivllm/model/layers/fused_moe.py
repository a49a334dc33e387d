"""A mixture of experts' MLPs (vLLM's ``FusedMoE``), written for clarity and the CPU, and
the sparse block that routes to them (``SparseMoeBlock``: Qwen2/3-MoE, Mixtral, OLMoE).

Each token goes to the ``top_k`` experts its router scores highest (softmax in float32
over all experts, the top k kept, renormalised to sum to 1 where the model says so), and
its output is the sum of those experts' outputs weighted by their scores. The tokens are
grouped by expert and only the experts that got tokens run, each on its tokens as one
matrix; their weighted outputs are added back into the tokens' rows (``index_add_``). A
decode step runs k small products per token in place of one large one. Where every
expert's weights are packed GGUF blocks alike (a GGUF file's stacked expert tensors), one
C call does all of that, the routing included (``gguf_kernels.moe_forward``, llama.cpp's
``mul_mat_id``): per expert, a decode step's host work would otherwise outweigh its
products.

Every expert is a gated MLP (SiLU; gpt-oss's clamped SwiGLU, with biases; Gemma 4's GELU)
of ordinary linear layers, so each has the layer's weight format (dense, oneDNN-packed on
the CPU; or GGUF blocks kept quantized) and its tensor-parallel sharding: every rank holds
a slice of every expert's intermediate features (gate/up column-parallel, down
row-parallel), and the experts' partial sums are all-reduced once, after they are added up.

Expert by expert, the routing depends on the data, so the host reads which experts got
tokens: a CPU graph capture sees the router's torch ops and runs such steps eagerly
(worker/cpu_graph.py); the one C call routes inside, so its decode steps are CPU graphs.
The models built on this layer say ``supports_cuda_graphs = False``, so that their decode
steps run eagerly on a GPU (a graph would have to run every expert on every token).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from minivllm.distributed.parallel_state import TPGroup
from minivllm.kernels import cpu_kernels, gguf_kernels
from minivllm.model.layers.activation import GeluAndMul, SiluAndMul, SwigluOAIAndMul
from minivllm.model.layers.linear import Linear, MergedColumnParallelLinear, RowParallelLinear
from minivllm.model.layers.quantization import gguf
from minivllm.model.layers.quantization.base import QuantizationConfig


class Expert(nn.Module):
    """One expert: down(act(gate(x), up(x))), gate/up fused; without the all-reduce. act is
    silu(gate) * up unless the model gives its own (gpt-oss's, with biases)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        tp: TPGroup,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        bias: bool = False,
        act_fn: nn.Module | None = None,
    ) -> None:
        super().__init__()
        sizes = {0: intermediate_size, 1: intermediate_size}
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, sizes, bias, tp, quant_config, f"{prefix}.gate_up_proj"
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias, tp, quant_config, f"{prefix}.down_proj"
        )
        self.act_fn = act_fn if act_fn is not None else SiluAndMul()
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial output (the sum over the ranks is the expert's output): the
        down projection's bias is rank 0's share."""
        down = self.down_proj
        bias = down.bias if self.tp.rank == 0 else None
        return down.quant_method.apply(down, self.act_fn(self.gate_up_proj(x)), bias)


class FusedMoE(nn.ModuleList):
    """The experts (children 0..num_experts-1, as checkpoints number them) and the routed
    sum of their outputs. The router is the model's: forward takes its logits.

    expert_scale (Gemma 4): a learned scale per expert (``expert_scale``, [num_experts]) on
    the chosen experts' weights, after their renormalisation."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        tp: TPGroup,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        bias: bool = False,
        act_fn: nn.Module | None = None,
        expert_scale: bool = False,
    ) -> None:
        """bias, act_fn: the experts' (gpt-oss's: SwigluOAIAndMul)."""
        super().__init__(
            Expert(hidden_size, intermediate_size, tp, quant_config, f"{prefix}.{e}", bias, act_fn)
            for e in range(num_experts)
        )
        self.top_k = top_k
        self.renormalize = renormalize
        self.tp = tp
        self.expert_scale = None
        if expert_scale:
            self.expert_scale = nn.Parameter(torch.empty(num_experts), requires_grad=False)
        # Every expert's packed GGUF blocks, when all are: the layer runs in one kernel call.
        self.packed: gguf_kernels.PackedExperts | None = None

    def process_weights_after_loading(self) -> None:
        """Once the experts' own layers are processed (weight_loading): gather their packed
        weights for ``gguf_kernels.moe_forward``, where every expert has them alike, with
        their biases (the down bias on rank 0 only: its share of the partial sums)."""
        act = self[0].act_fn
        gelu = isinstance(act, GeluAndMul) and act.approximate == "tanh"
        if not (isinstance(act, SiluAndMul | SwigluOAIAndMul) or gelu):
            return
        swiglu = (act.alpha, act.limit) if isinstance(act, SwigluOAIAndMul) else None
        biases = {}
        if self.expert_scale is not None:
            biases["expert_scale"] = self.expert_scale.float().contiguous()
        if self[0].gate_up_proj.bias is not None:
            biases["gate_up_bias"] = torch.stack([e.gate_up_proj.bias for e in self]).float()
            if self.tp.rank == 0:
                biases["down_bias"] = torch.stack([e.down_proj.bias for e in self]).float()
        self.packed = gguf.packed_experts(
            [gguf.quantized_weight(e.gate_up_proj.weight) for e in self],
            [gguf.quantized_weight(e.down_proj.weight) for e in self],
            swiglu=swiglu,
            gelu=gelu,
            **biases,
        )

    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [tokens, top_k] float32, expert ids [tokens, top_k]), best first."""
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.expert_scale is not None:
            weights = weights * self.expert_scale[ids]
        return weights, ids

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """x [tokens, hidden], router_logits [tokens, num_experts] -> [tokens, hidden]."""
        return self.tp.all_reduce(self.partial_sum(x, router_logits))

    def partial_sum(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output: the experts' partial outputs, weighted, summed."""
        if self.packed is not None and cpu_kernels.is_cpu_f32(x, router_logits):
            return gguf_kernels.moe_forward(
                x, router_logits, self.top_k, self.renormalize, self.packed
            )
        weights, ids = self.route(router_logits)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        # The (token, choice) pairs sorted by expert: each expert's tokens are one run.
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        tokens = order // self.top_k
        pair_weights = weights.flatten()[order].unsqueeze(-1)
        experts, counts = torch.unique(flat, return_counts=True)
        start = 0
        for expert, count in zip(experts.tolist(), counts.tolist(), strict=True):
            rows = tokens[start : start + count]
            y = self[expert](x[rows]) * pair_weights[start : start + count]
            out.index_add_(0, rows, y)
            start += count
        return out


class SparseMoeBlock(nn.Module):
    """A layer's MLP as a mixture of experts: the router (``gate``: hidden -> num_experts,
    no bias, replicated: every rank routes every token alike) and the experts, named as
    checkpoints name them (``gate``, ``experts.{e}``).

    With ``shared_intermediate_size`` (Qwen2-MoE), a shared expert runs on every token too,
    scaled by sigmoid(``shared_expert_gate``(x)), and is added to the routed sum (before the
    all-reduce: each rank holds a slice of it as of the others)."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        renormalize: bool,
        tp: TPGroup,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        shared_intermediate_size: int | None = None,
    ) -> None:
        super().__init__()
        self.gate = Linear(hidden_size, num_experts, False, quant_config, f"{prefix}.gate")
        self.experts = FusedMoE(
            num_experts,
            top_k,
            hidden_size,
            intermediate_size,
            renormalize,
            tp,
            quant_config,
            f"{prefix}.experts",
        )
        self.shared_expert = self.shared_expert_gate = None
        if shared_intermediate_size:
            self.shared_expert = Expert(
                hidden_size, shared_intermediate_size, tp, quant_config, f"{prefix}.shared_expert"
            )
            self.shared_expert_gate = Linear(
                hidden_size, 1, False, quant_config, f"{prefix}.shared_expert_gate"
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.shared_expert is None:
            return self.experts(x, self.gate(x))
        out = self.experts.partial_sum(x, self.gate(x))
        # In place, as a CPU graph replays torch's ops: out += sigmoid(gate(x)) * shared(x)
        shared = self.shared_expert(x)
        shared.mul_(torch.sigmoid_(self.shared_expert_gate(x)))
        return self.experts.tp.all_reduce(out.add_(shared))


def per_expert(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """transformers 5's fused 3D expert tensors (held in memory, written by some tools:
    ``experts.gate_up_proj`` [E, 2I, H], gate rows then up rows; ``experts.down_proj``
    [E, H, I]) cut into the checkpoints' per-expert names; the other tensors as they are."""
    for name, tensor in weights:
        if name.endswith(".experts.gate_up_proj"):
            experts = name.removesuffix("gate_up_proj")
            for e, gate_up in enumerate(tensor):
                gate, up = gate_up.chunk(2, dim=0)
                yield f"{experts}{e}.gate_proj.weight", gate
                yield f"{experts}{e}.up_proj.weight", up
        elif name.endswith(".experts.down_proj"):
            experts = name.removesuffix("down_proj")
            for e, down in enumerate(tensor):
                yield f"{experts}{e}.down_proj.weight", down
        else:
            yield name, tensor
