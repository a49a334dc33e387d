"""LFM2 (gated short convolutions + GQA attention) against HF transformers' own Lfm2 classes
on a tiny random-weight checkpoint: greedy tokens equal and logprobs within 1e-4, with
prompts cut into odd-sized chunks (the conv state carried across them), batched together,
preempted and recomputed, and decode steps replayed as CPU graphs."""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams

LAYER_TYPES = ["conv", "full_attention", "conv", "conv", "full_attention"]
PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n",
    "Once upon a time, in a land far away, there lived a",
    "A",
]
MAX_NEW = 20


def write_tiny_lfm2(folder: str, tokenizer) -> str:
    import transformers

    config = transformers.Lfm2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=192,  # 2/3 of it, rounded to 32s: a 128-wide MLP
        block_multiple_of=32,
        num_hidden_layers=len(LAYER_TYPES),
        layer_types=LAYER_TYPES,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        conv_L_cache=3,
        norm_eps=1e-5,
        initializer_range=0.3,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id or 0,
    )
    torch.manual_seed(0)
    model = transformers.Lfm2ForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # HF starts norms at one: random ones prove they are loaded
                param.add_(torch.randn_like(param) * 0.2)
            if "conv.conv" in name:  # taps of size ~1, so the convolution matters
                param.copy_(torch.randn_like(param))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def lfm2_model(tmp_path_factory, smollm2_tokenizer) -> str:
    return write_tiny_lfm2(str(tmp_path_factory.mktemp("tiny-lfm2")), smollm2_tokenizer)


def hf_greedy_with_logprobs(model, prompt_ids: list[int], max_new: int):
    """HF's greedy tokens and their logprobs, each from a whole forward pass over the
    sequence so far (no cache: faster here than generate's hybrid cache, and HF's plainest
    path)."""
    ids = list(prompt_ids)
    tokens, logprobs = [], []
    with torch.inference_mode():
        for _ in range(max_new):
            logits = model(torch.tensor([ids]), logits_to_keep=1).logits[0, -1].float()
            token = int(logits.argmax())
            tokens.append(token)
            logprobs.append(torch.log_softmax(logits, -1)[token].item())
            ids.append(token)
    return tokens, logprobs


@pytest.fixture(scope="module")
def hf_expected(lfm2_model, smollm2_tokenizer):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(lfm2_model, dtype=torch.float32).eval()
    expected = {}
    for prompt in PROMPTS:
        ids = smollm2_tokenizer.encode(prompt)
        expected[prompt] = hf_greedy_with_logprobs(hf, ids, MAX_NEW)
    return expected


def generate(model: str, **llm_kwargs):
    llm = LLM(model, max_model_len=128, enable_multiprocessing=False, **llm_kwargs)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    return llm, outputs


def assert_matches_hf(outputs, hf_expected) -> None:
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        tokens, logprobs = hf_expected[prompt]
        completion = output.outputs[0]
        assert completion.token_ids == tokens, prompt
        got = [step[t].logprob for step, t in zip(completion.logprobs, completion.token_ids)]
        assert got == pytest.approx(logprobs, abs=1e-4), prompt


@pytest.mark.parametrize("chunk", [7, pytest.param(13, marks=pytest.mark.slow)])
def test_chunked_batched_prompts_give_transformers_tokens(lfm2_model, hf_expected, chunk):
    llm, outputs = generate(lfm2_model, max_num_batched_tokens=chunk, max_num_seqs=4)
    assert_matches_hf(outputs, hf_expected)
    engine = llm.llm_engine.engine_core.engine_core
    assert not engine.scheduler.kv_cache_manager.enable_caching  # off: one log line said so
    worker = engine.executor.worker
    assert len(worker.state_layers()) == 3 and len(worker.model.attention_layers()) == 2


def test_preempted_requests_recompute_their_state(lfm2_model, hf_expected):
    # Attention: 2 layers x K and V x 2 heads x 16 floats = 512 bytes a token, 8 KiB a
    # block of 16. Room for 8 blocks and 4 states: one 128-token request fits, not four of
    # these at once (10 blocks).
    state_bytes = 3 * 64 * 2 * 4
    llm, outputs = generate(
        lfm2_model,
        max_num_batched_tokens=32,
        max_num_seqs=4,
        kv_cache_memory_bytes=8 * 8192 + 4 * state_bytes,
    )
    engine = llm.llm_engine.engine_core.engine_core
    assert engine.executor.worker.num_state_slots == 4
    assert engine.scheduler.num_preemptions > 0
    assert_matches_hf(outputs, hf_expected)


def test_decode_steps_replay_as_cpu_graphs(monkeypatch, lfm2_model, hf_expected):
    from minivllm.kernels.conv_kernels import load_conv_kernels
    from minivllm.kernels.cpu_kernels import load_kernels

    if load_conv_kernels() is None or load_kernels("MINIVLLM_CPU_ATTN_KERNEL") is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("MINIVLLM_CPU_GRAPHS", "1")
    llm, outputs = generate(lfm2_model)
    assert_matches_hf(outputs, hf_expected)
    graphs = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.cpu_graphs
    assert graphs and all(graph is not None for graph in graphs.values()), graphs


@pytest.mark.slow
def test_two_ranks_split_convolutions_by_channels(lfm2_model, hf_expected):
    """Tensor parallelism: each rank holds its channels of B, C and x, their taps and their
    conv states, and its attention heads; the tokens stay HF's."""
    llm = LLM(lfm2_model, max_model_len=128, tensor_parallel_size=2)
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
        outputs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    for prompt, output in zip(PROMPTS, outputs):
        assert output.outputs[0].token_ids == hf_expected[prompt][0], prompt


def test_profile_run_binds_its_own_states_and_leaves_the_real_ones(lfm2_model):
    from minivllm import EngineArgs
    from minivllm.engine.create_config import create_vllm_config
    from minivllm.worker.worker import Worker

    worker = Worker(create_vllm_config(EngineArgs(model=lfm2_model, max_model_len=128)))
    worker.init_device()
    worker.load_model()
    worker.initialize_kv_cache(worker.determine_num_blocks())
    layers = worker.state_layers()
    real = [list(layer.states) for layer in layers]
    for states in real:
        for state in states:
            state.fill_(1.0)
    worker.profile_run()
    for layer, states in zip(layers, real):
        assert layer.states == states and layer.step is worker.state_cache.step
        assert all(bool((s == 1.0).all()) for s in states)
