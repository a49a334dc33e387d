"""load_format="dummy": random weights in the model's shapes, no weight file read."""

from __future__ import annotations

import os

import pytest
import torch

from minivllm import LLM, EngineArgs, SamplingParams
from minivllm.engine.create_config import create_vllm_config
from minivllm.worker.worker import Worker
from tests.conftest import write_tiny_checkpoint


@pytest.fixture(scope="module")
def config_only(tmp_path_factory, smollm2_tokenizer) -> str:
    """A tiny Qwen3 folder whose weight file is gone: only its config and tokenizer."""
    folder = str(tmp_path_factory.mktemp("tiny-qwen3-config-only"))
    write_tiny_checkpoint("qwen3", folder, smollm2_tokenizer)
    os.remove(os.path.join(folder, "model.safetensors"))
    return folder


def dummy_worker(model: str, seed: int = 0) -> Worker:
    args = EngineArgs(model=model, load_format="dummy", seed=seed, max_model_len=128)
    worker = Worker(create_vllm_config(args))
    worker.init_device()
    worker.load_model()
    return worker


def test_every_weight_is_drawn_small_and_the_seed_fixes_them(config_only):
    params = dict(dummy_worker(config_only).model.named_parameters())
    again = dict(dummy_worker(config_only).model.named_parameters())
    other = dict(dummy_worker(config_only, seed=1).model.named_parameters())
    assert params
    for name, p in params.items():
        if p.numel() == 0:
            continue  # a CPU linear's float copy, emptied once its packed copy is made
        assert p.abs().max() <= 1e-3 and p.std() > 1e-4, name  # filled, not left empty
        assert torch.equal(p, again[name]), name
        assert not torch.equal(p, other[name]), name


def test_the_engine_generates_from_dummy_weights(config_only):
    llm = LLM(config_only, load_format="dummy", max_model_len=128, enable_multiprocessing=False)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    out = llm.generate(["Hello, my name is"], params, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8


def test_a_checkpoint_without_weights_fails_without_dummy(config_only):
    worker = Worker(create_vllm_config(EngineArgs(model=config_only, max_model_len=128)))
    worker.init_device()
    with pytest.raises(FileNotFoundError):
        worker.load_model()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(load_format="pt"), "load_format must be one of"),
        (dict(load_format="gguf"), "does not read"),
        (dict(load_format="dummy", quantization="gguf"), "makes plain weights"),
    ],
)
def test_bad_load_formats_are_refused(config_only, kwargs, message):
    with pytest.raises(ValueError, match=message):
        create_vllm_config(EngineArgs(model=config_only, **kwargs))


def test_load_format_is_a_cli_flag():
    import argparse

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(["--load-format", "dummy"]))
    assert args.load_format == "dummy"
