"""LoRA adapters served per request: greedy outputs equal HF transformers' on the base
checkpoint with the adapter merged into its weights, whatever the batch mixes (adapters,
the base model, more adapters than slots), with prefix caching and chunked prefill; bad
adapters fail alone."""

from __future__ import annotations

import os

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.lora.request import LoRARequest
from tests.conftest import write_tiny_checkpoint
from tests.lora.conftest import merge_adapter, merged_weights, write_adapter
from tests.model.test_hf_parity import hf_greedy

PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    # Longer than two KV blocks (16 tokens): its blocks are cached, per adapter.
    "Once upon a time, in a land far away, there lived a king who had three daughters, and "
    "the youngest of them was so beautiful that the sun itself",
]
MAX_NEW = 12
ENGINE = dict(enable_multiprocessing=False, kv_cache_memory_bytes=1 << 24, max_model_len=256)
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def lora_setup(request, tmp_path_factory, smollm2_tokenizer):
    """(base, [adapter folders], {None or adapter folder: HF greedy per prompt})."""
    import transformers

    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    base = write_tiny_checkpoint(request.param, str(root / "base"), smollm2_tokenizer)
    adapters = [
        write_adapter(base, str(root / "a1"), seed=1),
        write_adapter(base, str(root / "a2"), seed=2, rank=4, alpha=8, use_rslora=True),
        write_adapter(base, str(root / "a3"), seed=3, targets=("q_proj", "v_proj")),
    ]
    expected = {}
    for adapter in [None, *adapters]:
        folder = base if adapter is None else merge_adapter(base, adapter, adapter + "-merged")
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        ids = [smollm2_tokenizer.encode(p) for p in PROMPTS]
        expected[adapter] = [hf_greedy(model.eval(), i, MAX_NEW, None) for i in ids]
    return base, adapters, expected


def lora(path: str, index: int) -> LoRARequest:
    return LoRARequest(os.path.basename(path), index + 1, path)


def test_each_request_gets_its_adapter(lora_setup):
    base, adapters, expected = lora_setup
    assert expected[adapters[0]] != expected[None]  # the adapters change the outputs
    llm = LLM(base, enable_lora=True, max_loras=2, max_lora_rank=8, **ENGINE)
    # One batch: every prompt with each adapter and with none; three adapters, two slots.
    choices = [None, *adapters]
    prompts = [p for p in PROMPTS for _ in choices]
    requests = [None if a is None else lora(a, adapters.index(a)) for _ in PROMPTS for a in choices]
    outputs = llm.generate(prompts, GREEDY, lora_request=requests, use_tqdm=False)
    for i, output in enumerate(outputs):
        adapter = choices[i % len(choices)]
        assert output.outputs[0].token_ids == expected[adapter][i // len(choices)], (i, adapter)
    # Again, one adapter for the whole batch: now the prompts hit the prefix cache, each
    # under its own adapter's blocks only.
    for index, adapter in enumerate(adapters):
        outputs = llm.generate(PROMPTS, GREEDY, lora_request=lora(adapter, index), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected[adapter]
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected[None]


def test_decode_graphs_per_adapter_slot(lora_setup):
    """CPU decode graphs are captured per batch size and adapter slot: the base model's
    without adapters, each slot's with its LoRA kernels; a step of the same size under
    another slot or none replays its own (a graph keyed by size alone would replay another
    adapter's). Slots refilled with another adapter keep their graphs: the kernels read the
    slot's memory."""
    base, adapters, expected = lora_setup
    llm = LLM(base, enable_lora=True, max_loras=2, **ENGINE)
    graphs = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.cpu_graphs
    assert graphs == {}
    for _ in range(2):
        for index in (None, 0, 1, 2):  # the third adapter evicts the first from its slot
            request = None if index is None else lora(adapters[index], index)
            outputs = llm.generate(PROMPTS, GREEDY, lora_request=request, use_tqdm=False)
            adapter = None if index is None else adapters[index]
            assert [o.outputs[0].token_ids for o in outputs] == expected[adapter], index
    assert {3, (3, 0), (3, 1)} <= set(graphs) and graphs[(3, 0)] is not None


def test_chunked_prefill_and_one_slot(lora_setup):
    base, adapters, expected = lora_setup
    llm = LLM(
        base, enable_lora=True, max_loras=1, max_num_batched_tokens=8, enable_prefix_caching=False,
        **ENGINE,
    )  # fmt: skip
    requests = [lora(adapters[i % 2], i % 2) for i in range(len(PROMPTS))]
    outputs = llm.generate(PROMPTS, GREEDY, lora_request=requests, use_tqdm=False)
    for i, output in enumerate(outputs):
        assert output.outputs[0].token_ids == expected[adapters[i % 2]][i]


def test_bad_adapters_are_refused(lora_setup, tmp_path, smollm2_tokenizer):
    base, adapters, expected = lora_setup
    plain = LLM(base, **ENGINE)
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        plain.generate("a", GREEDY, lora_request=lora(adapters[0], 0), use_tqdm=False)
    llm = LLM(base, enable_lora=True, max_lora_rank=4, **ENGINE)
    with pytest.raises(ValueError, match="greater than max_lora_rank 4"):
        llm.generate("a", GREEDY, lora_request=lora(adapters[0], 0), use_tqdm=False)
    with pytest.raises(ValueError, match="No adapter found"):
        llm.generate("a", GREEDY, lora_request=LoRARequest("x", 9, str(tmp_path)), use_tqdm=False)
    with pytest.raises(ValueError, match="lora_int_id must be > 0"):
        LoRARequest("x", 0, adapters[0])
    with pytest.raises(ValueError, match="lengths of prompts"):
        llm.generate(["a", "b"], GREEDY, lora_request=[None], use_tqdm=False)
    # An adapter made for another model passes the frontend's checks and fails in the
    # engine core, alone: the request beside it finishes.
    other = write_tiny_checkpoint(
        "llama", str(tmp_path / "other"), smollm2_tokenizer, hidden_size=32
    )
    wrong = write_adapter(other, str(tmp_path / "wrong"), seed=0, rank=4)
    good, bad = llm.generate(
        PROMPTS[:2],
        GREEDY,
        lora_request=[lora(adapters[1], 1), LoRARequest("wrong", 7, wrong)],
        use_tqdm=False,
    )
    assert good.outputs[0].token_ids == expected[adapters[1]][0]
    assert bad.outputs[0].finish_reason == "error"
    # So does one whose weights file is not a safetensors file (the workers read it: an
    # exception there other than a ValueError would end a worker process, and the engine).
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4}')
    (corrupt / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="Cannot read the adapter's"):
        llm.llm_engine.add_lora(LoRARequest("corrupt", 8, str(corrupt)))
    good, bad = llm.generate(
        PROMPTS[:2],
        GREEDY,
        lora_request=[lora(adapters[1], 1), LoRARequest("corrupt", 8, str(corrupt))],
        use_tqdm=False,
    )
    assert good.outputs[0].token_ids == expected[adapters[1]][0]
    assert bad.outputs[0].finish_reason == "error"


def test_tensor_parallel_ranks_hold_their_slices(lora_setup):
    """Two worker processes: column-parallel layers keep their rows of B, row-parallel ones
    their columns of A (their partial deltas summed with the layer's)."""
    base, adapters, expected = lora_setup
    llm = LLM(
        base, enable_lora=True, max_loras=2, tensor_parallel_size=2, max_model_len=256,
        kv_cache_memory_bytes=1 << 24,
    )  # fmt: skip
    requests = [lora(adapters[0], 0), None, lora(adapters[2], 2)]
    outputs = llm.generate(PROMPTS, GREEDY, lora_request=requests, use_tqdm=False)
    for i, (output, request) in enumerate(zip(outputs, requests)):
        adapter = None if request is None else request.lora_path
        assert output.outputs[0].token_ids == expected[adapter][i]


def test_an_adapter_on_the_bundled_gguf_model(smollm2_hf, smollm2_path, tmp_path):
    """SmolLM2 read from its GGUF: dequantized at load (quantization="none"), an adapter's
    greedy tokens equal HF's on the same weights merged; kept quantized (the int8 kernels),
    the adapter applies there too, and a batch mixing it with the base model changes
    neither."""
    import copy

    state = {k: v.detach().clone() for k, v in smollm2_hf.state_dict().items()}
    adapter = write_adapter(state, str(tmp_path / "smol"), seed=5, std=0.05)
    merged = copy.deepcopy(smollm2_hf)
    merged.load_state_dict(merged_weights(state, adapter))
    request = LoRARequest("smol", 1, adapter)
    dense = LLM(smollm2_path, quantization="none", enable_lora=True, **ENGINE)
    ids = [dense.get_tokenizer().encode(p) for p in PROMPTS]
    expected = [hf_greedy(merged.eval(), i, MAX_NEW, None) for i in ids]
    base = [hf_greedy(smollm2_hf, i, MAX_NEW, None) for i in ids]
    assert expected != base
    outputs = dense.generate(PROMPTS, GREEDY, lora_request=request, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected

    quantized = LLM(smollm2_path, enable_lora=True, **ENGINE)
    alone = quantized.generate(PROMPTS, GREEDY, lora_request=request, use_tqdm=False)
    plain = quantized.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in alone] != [o.outputs[0].token_ids for o in plain]
    mixed = quantized.generate(
        PROMPTS * 2, GREEDY, lora_request=[request] * 3 + [None] * 3, use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in mixed] == [
        o.outputs[0].token_ids for o in alone + plain
    ]


def test_embeddings_with_an_adapter(lora_setup):
    """The pooling runner takes adapters too: an embedding under an adapter equals the
    merged checkpoint's (itself HF's, as tests/entrypoints/test_llm_embed.py shows)."""
    base, adapters, _ = lora_setup
    merged = adapters[0] + "-merged"  # written by the fixture
    llm = LLM(base, runner="pooling", enable_lora=True, **ENGINE)
    outputs = llm.embed(PROMPTS, lora_request=lora(adapters[0], 0), use_tqdm=False)
    plain = llm.embed(PROMPTS, use_tqdm=False)
    reference = LLM(merged, runner="pooling", **ENGINE).embed(PROMPTS, use_tqdm=False)
    for output, expected, other in zip(outputs, reference, plain):
        assert output.outputs.embedding == pytest.approx(expected.outputs.embedding, abs=1e-5)
        assert output.outputs.embedding != pytest.approx(other.outputs.embedding, abs=1e-3)
