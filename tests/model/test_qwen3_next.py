"""Qwen3-Next's and Qwen3.5's layers against transformers' own modules on tiny random
configs: the Gated DeltaNet (on a whole prompt, on the prompt cut into pieces that carry
the state, and in decode steps of a batch), with each kernel path (C, torch); the sparse
MLP with its gated shared expert."""

from __future__ import annotations

import pytest
import torch

from minivllm.model.layers.state_cache import StateCache
from minivllm.model.weight_loading import process_weights_after_loading

SIZES = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,  # three Gated DeltaNet layers, then full attention
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=24,
    linear_conv_kernel_dim=4,
    rms_norm_eps=1e-6,
    initializer_range=0.1,
    max_position_embeddings=512,
)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)


def hf_config(arch: str, vocab_size: int = 256, **extra):
    """A tiny config of arch ("qwen3-next", "qwen3.5", "qwen3.5-moe")."""
    import transformers

    common = {**SIZES, "vocab_size": vocab_size, **extra}
    if arch == "qwen3-next":
        return transformers.Qwen3NextConfig(
            **common, **MOE, shared_expert_intermediate_size=48, norm_topk_prob=True,
            mlp_only_layers=[1], tie_word_embeddings=False,
        )  # fmt: skip
    if arch == "qwen3.5":
        return transformers.Qwen3_5TextConfig(**common, tie_word_embeddings=False)
    if arch == "qwen3.5-moe":
        common.pop("intermediate_size")
        return transformers.Qwen3_5MoeTextConfig(
            **common, **MOE, shared_expert_intermediate_size=48, tie_word_embeddings=False
        )
    raise ValueError(arch)


HF_CLASSES = {
    "qwen3-next": "Qwen3NextForCausalLM",
    "qwen3.5": "Qwen3_5ForCausalLM",
    "qwen3.5-moe": "Qwen3_5MoeForCausalLM",
}


def hf_model(arch: str, seed: int = 0, **extra):
    """transformers' model of that config with random weights, norms moved off their
    starting values (so that a weight not loaded shows)."""
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, HF_CLASSES[arch])(hf_config(arch, **extra)).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "dt_bias" in name:
                param.add_(torch.randn_like(param) * 0.2)
            # Routers with well-separated scores: no expert is chosen by a rounding.
            if name.endswith("mlp.gate.weight"):
                param.mul_(10)
    return model


def engine_model(hf):
    """This engine's model of hf's config, loaded with hf's weights (no attention backend:
    the tests here run the layers without attention)."""
    from minivllm.model.registry import MODEL_REGISTRY

    model = MODEL_REGISTRY[type(hf).__name__](hf.config, backend=None)
    model.load_weights(hf.state_dict().items())
    process_weights_after_loading(model)
    return model.eval()


def bind_states(model, num_slots: int = 4) -> StateCache:
    return StateCache(model.state_layers(), num_slots, max_num_reqs=num_slots, device="cpu")


def begin(cache: StateCache, slots, lengths, first: list[bool]) -> None:
    bounds = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0).to(torch.int32)
    cache.begin_step(slots, first, bounds, bounds, max(lengths))


KERNELS = {"c": "1", "torch": "0"}


@pytest.fixture(params=list(KERNELS), ids=list(KERNELS))
def kernel_switch(request, monkeypatch):
    monkeypatch.setenv("MINIVLLM_CPU_LAYER_KERNELS", KERNELS[request.param])
    return request.param


@pytest.mark.parametrize("arch", ["qwen3-next", "qwen3.5"])
def test_gated_deltanet_equals_transformers(arch, kernel_switch):
    """Layer 0's token mixer on a 23-token prompt: whole; cut into pieces of 9, 1 and 13
    beside another sequence's; then 3 decode steps of two sequences at once. Each output
    row equals HF's on the whole sequence so far (no cache: its own chunked form)."""
    hf = hf_model(arch)
    model = engine_model(hf)
    mine = model.model.layers[0].linear_attn
    theirs = hf.model.layers[0].linear_attn
    assert (mine.kernels is not None) == (kernel_switch == "c")
    cache = bind_states(model)
    torch.manual_seed(1)
    x = torch.randn(2, 26, SIZES["hidden_size"])
    with torch.inference_mode():
        want = [theirs(x[i : i + 1])[0] for i in range(2)]
        begin(cache, [2], [23], [True])
        torch.testing.assert_close(mine(None, x[0, :23], None), want[0][:23], atol=1e-4, rtol=1e-4)
        # Pieces: sequence 0 again from scratch in slot 1, beside sequence 1 in slot 3.
        done = 0
        for piece in (9, 1, 13):
            rows = torch.cat([x[0, done : done + piece], x[1, done : done + piece]])
            begin(cache, [1, 3], [piece, piece], [done == 0, done == 0])
            out = mine(None, rows, None)
            for i in range(2):
                got = out[i * piece : (i + 1) * piece]
                torch.testing.assert_close(got, want[i][done : done + piece], atol=1e-4, rtol=1e-4)
            done += piece
        for t in range(23, 26):  # decode steps, one row a sequence
            begin(cache, [1, 3], [1, 1], [False, False])
            out = mine(None, x[:, t], None)
            torch.testing.assert_close(out, torch.stack([w[t] for w in want]), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["qwen3-next", "qwen3.5-moe"])
def test_sparse_mlp_with_its_gated_shared_expert_equals_transformers(arch):
    """Layer 0's MLP: the routed experts (renormalised top-2) plus the shared expert
    scaled by sigmoid(shared_expert_gate(x))."""
    hf = hf_model(arch)
    model = engine_model(hf)
    torch.manual_seed(2)
    x = torch.randn(7, SIZES["hidden_size"])
    with torch.inference_mode():
        want = hf.model.layers[0].mlp(x[None])[0]
        got = model.model.layers[0].mlp(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_qwen3_next_keeps_dense_layers_where_its_config_says():
    hf = hf_model("qwen3-next")
    model = engine_model(hf)
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == [
        "SparseMoeBlock", "MLP", "SparseMoeBlock", "SparseMoeBlock",
    ]  # fmt: skip
    assert len(model.state_layers()) == 3 and len(model.attention_layers()) == 1


def test_a_tensor_parallel_split_is_refused():
    from minivllm.distributed.parallel_state import TPGroup
    from minivllm.model.models.qwen3_next import Qwen3NextForCausalLM

    with pytest.raises(ValueError, match="tensor_parallel_size=1"):
        Qwen3NextForCausalLM(hf_config("qwen3-next"), None, TPGroup(rank=0, size=2))


def test_an_image_and_text_checkpoint_loads_its_language_model():
    """Qwen3.5's released checkpoints (Qwen3_5ForConditionalGeneration) name the text
    weights model.language_model.*; the vision tower and the MTP head are left out."""
    from minivllm.model.models.qwen3_5 import Qwen3_5ForConditionalGeneration

    hf = hf_model("qwen3.5")
    renamed = [
        (name.replace("model.", "model.language_model.", 1), tensor)
        for name, tensor in hf.state_dict().items()
    ]
    renamed += [
        ("model.visual.patch_embed.proj.weight", torch.zeros(2)),
        ("mtp.fc.weight", torch.zeros(2)),
    ]
    model = Qwen3_5ForConditionalGeneration(hf.config, backend=None)
    model.load_weights(renamed)
    mine, theirs = model.model.layers[0].linear_attn, hf.model.layers[0].linear_attn
    assert torch.equal(
        mine.in_proj_qkvz.weight, torch.cat([theirs.in_proj_qkv.weight, theirs.in_proj_z.weight])
    )
    assert torch.equal(
        mine.in_proj_ba.weight, torch.cat([theirs.in_proj_b.weight, theirs.in_proj_a.weight])
    )


@pytest.mark.parametrize("elem", [4])  # the CPU's float32 cache
def test_a_4k_request_costs_under_a_third_of_a_llama_of_its_shape(elem):
    """Acceptance 3 on a Qwen3.5-0.8B-like shape: 24 layers of width 1024, one in four full
    attention (2 KV heads of 256), 18 Gated DeltaNet layers whose state (as the layer
    declares it: a [6144, 3] conv state and [16, 128, 128] float32) does not grow. A Llama
    of that width and layer count attends in all 24."""
    from minivllm.core.kv_cache_utils import KVCacheSpec
    from minivllm.model.models.qwen3_next import GatedDeltaNet

    config = hf_config(
        "qwen3.5", hidden_size=1024, num_hidden_layers=24, num_attention_heads=8,
        num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
        linear_key_head_dim=128, linear_value_head_dim=128, intermediate_size=3584,
    )  # fmt: skip
    with torch.device("meta"):
        layer = GatedDeltaNet(config, None, "layer")
    state = 18 * sum(s.nbytes for s in layer.state_shapes())
    assert state == 18 * (6144 * 3 * 4 + 16 * 128 * 128 * 4)
    per_layer = 2 * 2 * 256 * 16 * elem  # K and V of a 16-token block
    qwen = KVCacheSpec(16, 6 * per_layer, state)
    llama = KVCacheSpec(16, 24 * per_layer)
    assert qwen.request_bytes(4096) < llama.request_bytes(4096) / 3
    growth = qwen.request_bytes(4096) - qwen.request_bytes(128)
    assert growth == (4096 - 128) // 16 * 6 * per_layer  # only the attention layers grow


# --- The engine against transformers on tiny checkpoints --------------------------------

MAX_NEW = 24
PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n",
    "Once upon a time, in a land far away, there lived a",
]


def write_checkpoint(arch: str, folder: str, tokenizer) -> str:
    """A tiny random-weight checkpoint of arch written by transformers' own class, with
    large weights (peaked logits: greedy choices do not hinge on rounding)."""
    model = hf_model(
        arch,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


# Qwen3.5 dense in the default run; the MoE ones (HF's experts, token by token) are slow.
CASES = [
    "qwen3.5",
    pytest.param("qwen3-next", marks=pytest.mark.slow),
    pytest.param("qwen3.5-moe", marks=pytest.mark.slow),
]


@pytest.fixture(scope="module", params=CASES)
def case(request, tmp_path_factory, smollm2_tokenizer):
    """(checkpoint folder, {prompt: HF's greedy tokens and their logprobs})."""
    import transformers

    from minivllm.tokenizer import load_tokenizer
    from tests.model.test_hf_parity_archs import hf_greedy_with_logprobs

    folder = str(tmp_path_factory.mktemp(f"tiny-{request.param}"))
    write_checkpoint(request.param, folder, smollm2_tokenizer)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    ).eval()
    tokenizer = load_tokenizer(folder)  # the engine's (the saved files', not the GGUF's)
    expected = {p: hf_greedy_with_logprobs(hf, tokenizer.encode(p), MAX_NEW) for p in PROMPTS}
    return folder, expected


def generate(folder: str, max_tokens: int = MAX_NEW, **engine):
    from minivllm import LLM, SamplingParams

    engine.setdefault("max_model_len", 128)
    llm = LLM(folder, enable_multiprocessing=False, **engine)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    return llm, llm.generate(PROMPTS, params, use_tqdm=False)


def assert_matches_hf(outputs, expected) -> None:
    for output in outputs:
        tokens, logprobs = expected[output.prompt]
        completion = output.outputs[0]
        assert completion.token_ids == tokens, output.prompt
        got = [step[t].logprob for step, t in zip(completion.logprobs, completion.token_ids)]
        assert got == pytest.approx(logprobs, abs=1e-4), output.prompt


ENGINES = {
    "chunked": dict(max_num_batched_tokens=7),  # odd chunks beside other requests' decodes
    "whole": dict(max_num_batched_tokens=512, max_num_seqs=3),  # a request waits for a slot
}


@pytest.mark.parametrize("engine", ["chunked", pytest.param("whole", marks=pytest.mark.slow)])
def test_greedy_and_logprobs_equal_transformers(case, engine):
    folder, expected = case
    llm, outputs = generate(folder, **ENGINES[engine])
    assert_matches_hf(outputs, expected)
    worker = llm.llm_engine.engine_core.engine_core.executor.worker
    assert len(worker.state_layers()) == 3 and len(worker.model.attention_layers()) == 1
    # The dense model's decode steps replay as CPU graphs: every op is a C kernel (float
    # experts run through torch, fused_moe.py, so the MoE ones run eagerly).
    graphs = worker.model_runner.cpu_graphs
    dense = type(worker.model).__name__ == "Qwen3_5ForCausalLM"
    if dense and graphs is not None and worker.model.model.layers[0].linear_attn.kernels:
        assert any(graph is not None for graph in graphs.values()), graphs


def test_preempted_requests_recompute_their_state(case):
    """A budget of 8 states: 4 slots (half the budget at most) and 11 blocks of 16 tokens
    beside them, where the four requests' 56 new tokens need 18: some are preempted and
    start again from position 0. Their tokens are the engine's with room for all (whose
    first 24 are HF's), their logprobs within 1e-4."""
    folder, expected = case
    conv_dim = 2 * SIZES["linear_num_key_heads"] * SIZES["linear_key_head_dim"]
    conv_dim += SIZES["linear_num_value_heads"] * SIZES["linear_value_head_dim"]
    rule = SIZES["linear_num_value_heads"] * SIZES["linear_key_head_dim"]
    rule *= SIZES["linear_value_head_dim"]
    state = 3 * 4 * (conv_dim * (SIZES["linear_conv_kernel_dim"] - 1) + rule)
    engine = dict(max_model_len=96, max_num_batched_tokens=32, max_num_seqs=4, max_tokens=56)
    _, plain = generate(folder, **engine)
    llm, outputs = generate(folder, kv_cache_memory_bytes=8 * state, **engine)
    core = llm.llm_engine.engine_core.engine_core
    assert core.executor.worker.num_state_slots == 4
    assert core.scheduler.num_preemptions > 0
    for got, want in zip(outputs, plain, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids, got.prompt
        assert got.outputs[0].token_ids[:MAX_NEW] == expected[got.prompt][0], got.prompt
        got_lp, want_lp = (
            [step[t].logprob for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
            for o in (got, want)
        )
        assert got_lp == pytest.approx(want_lp, abs=1e-4), got.prompt
