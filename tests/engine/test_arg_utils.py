"""vLLM's module paths re-export minivllm's own objects, and the seeds' flags parse."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch


def test_vllm_module_paths_are_the_same_objects():
    import minivllm
    from minivllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
    from minivllm.v1.engine.async_llm import AsyncLLM

    assert EngineArgs is minivllm.EngineArgs
    assert AsyncEngineArgs is minivllm.AsyncEngineArgs
    assert AsyncLLM is minivllm.AsyncLLM


def test_flexible_parser_takes_underscored_flags_and_keeps_values():
    from minivllm.engine.arg_utils import EngineArgs
    from minivllm.utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--max_model_len=64", "--model", "some_dir/a_b", "--enforce_eager"])
    engine_args = EngineArgs.from_cli_args(args)
    assert engine_args.max_model_len == 64
    assert engine_args.model == "some_dir/a_b"
    assert engine_args.enforce_eager is True


SEED_003_FLAGS = (
    "--tensor-parallel-size 1 --max-num-seqs 500 --trust-remote-code --enforce-eager "
    "--max-num-batched-tokens 512 --enable-chunked-prefill --gpu-memory-utilization 0.02 "
    "--swap-space 1"
).split()


def test_server_parser_accepts_the_seed_flags():
    from minivllm.entrypoints.openai.cli_args import engine_args_from, make_arg_parser
    from minivllm.utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    args = engine_args_from(parser.parse_args(["--model", "m", *SEED_003_FLAGS]))
    assert (args.model, args.max_num_seqs, args.max_num_batched_tokens) == ("m", 500, 512)
    assert args.trust_remote_code and args.enforce_eager and args.enable_chunked_prefill
    assert (args.gpu_memory_utilization, args.swap_space) == (0.02, 1.0)
    off = parser.parse_args(["--no-enable-chunked-prefill"])
    assert engine_args_from(off).enable_chunked_prefill is False


@pytest.mark.parametrize("field, value", [("gpu_memory_utilization", 0.0), ("swap_space", -1)])
def test_bad_flag_values_are_rejected(field, value):
    from minivllm.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match=field):
        EngineArgs(**{field: value}).validate()


@pytest.mark.parametrize("cuda_present, expected", [(False, "cpu"), (True, "cuda")])
def test_device_auto_is_the_default_and_the_config_names_what_it_resolved_to(
    monkeypatch, smollm2_path, cuda_present, expected
):
    """vLLM's default: the workers get "cuda" or "cpu", never "auto"."""
    from minivllm.engine.arg_utils import EngineArgs
    from minivllm.engine.create_config import create_vllm_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda_present)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation: True)
    assert EngineArgs().device == "auto"
    assert create_vllm_config(EngineArgs(model=smollm2_path)).device == expected


# ---------------------------------------------------------------------- one set of flags


def _engine_flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The parser's flags that name an engine argument (``--max-num-seqs``), by dest."""
    from minivllm.engine.arg_utils import AsyncEngineArgs

    names = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    return {a.dest: a for a in parser._actions if a.option_strings and a.dest in names}


def test_serve_has_a_flag_with_help_for_every_engine_argument():
    from minivllm.engine.arg_utils import AsyncEngineArgs
    from minivllm.entrypoints.openai.cli_args import make_arg_parser

    flags = _engine_flags(make_arg_parser(argparse.ArgumentParser()))
    for f in dataclasses.fields(AsyncEngineArgs):
        action = flags[f.name]
        assert "--" + f.name.replace("_", "-") in action.option_strings
        assert action.help and action.help == f.metadata["help"]
        assert action.default == f.default
        if f.metadata["choices"]:
            assert list(action.choices) == list(f.metadata["choices"])
    assert set(flags) == {f.name for f in dataclasses.fields(AsyncEngineArgs)}


@pytest.mark.parametrize("name", ["throughput", "latency"])
def test_offline_benches_take_the_same_flags_for_their_engine_arguments(name):
    from minivllm.bench import BENCHMARKS
    from minivllm.bench.common import BENCH_ENGINE_ARGS
    from minivllm.entrypoints.openai.cli_args import make_arg_parser

    parser = argparse.ArgumentParser()
    BENCHMARKS[name].add_cli_args(parser)
    bench = _engine_flags(parser)
    serve = _engine_flags(make_arg_parser(argparse.ArgumentParser()))
    assert set(bench) == set(BENCH_ENGINE_ARGS)
    for dest, action in bench.items():
        same = ("option_strings", "help", "default", "choices", "type")
        assert [getattr(action, k) for k in same] == [getattr(serve[dest], k) for k in same]


def test_choices_and_bounds_come_from_the_field_metadata():
    from minivllm.engine.arg_utils import EngineArgs

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    with pytest.raises(SystemExit):
        parser.parse_args(["--scheduling-policy", "lifo"])
    assert parser.parse_args(["--kv-cache-memory-bytes", "2G"]).kv_cache_memory_bytes == 2 << 30
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority"):
        EngineArgs(scheduling_policy="lifo").validate()
    with pytest.raises(ValueError, match="quantization must be one of gguf, mxfp4, none"):
        EngineArgs(quantization="awq").validate()
    with pytest.raises(ValueError, match="block_size must be positive, got 0"):
        EngineArgs(block_size=0).validate()
    # vLLM's tokenizer modes: the fast tokenizer's names pass, the others are refused.
    assert parser.parse_args(["--tokenizer-mode", "hf"]).tokenizer_mode == "hf"
    with pytest.raises(ValueError, match="tokenizer_mode must be one of auto, hf"):
        EngineArgs(tokenizer_mode="mistral").validate()
    EngineArgs(max_model_len=None, quantization=None).validate()  # None: the default's rule


def test_only_picks_the_flags():
    from minivllm.engine.arg_utils import EngineArgs

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser(), only=["seed", "device"])
    assert set(_engine_flags(parser)) == {"seed", "device"}
