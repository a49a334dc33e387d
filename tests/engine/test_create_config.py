"""Rules of engine/create_config.py: the default sampling parameters, async scheduling's
default by device."""

from __future__ import annotations

import argparse
import json

import pytest

from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.create_config import read_sampling_defaults


@pytest.fixture
def model_dir(tmp_path):
    config = {"temperature": 0.7, "max_new_tokens": 5, "do_sample": True, "top_p": None}
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_the_generation_config_gives_the_sampling_fields_in_vllms_names(model_dir):
    assert read_sampling_defaults("auto", model_dir) == {"temperature": 0.7, "max_tokens": 5}
    assert read_sampling_defaults("vllm", model_dir) == {}
    assert read_sampling_defaults(model_dir, "/no/such/model") == {
        "temperature": 0.7,
        "max_tokens": 5,
    }


def test_override_generation_config_wins_over_the_file_and_over_vllms_own(model_dir):
    """vLLM's --override-generation-config: JSON in generation_config.json's names."""
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(
        parser.parse_args(["--override-generation-config", '{"temperature": 0.2, "top_k": 1}'])
    )
    overrides = args.override_generation_config
    expected = {"temperature": 0.2, "max_tokens": 5, "top_k": 1}
    assert read_sampling_defaults("auto", model_dir, overrides) == expected
    assert read_sampling_defaults("vllm", model_dir, {"max_new_tokens": 9}) == {"max_tokens": 9}
    with pytest.raises(ValueError, match="Unknown override_generation_config field.*tempreature"):
        read_sampling_defaults("auto", model_dir, {"tempreature": 0.2})


@pytest.mark.parametrize(
    "device, extra, expected",
    [
        ("cuda", {}, True),  # vLLM's default on CUDA
        ("cpu", {}, False),  # the host is the device: nothing to overlap
        ("cuda", {"tensor_parallel_size": 2}, False),  # one worker only
        ("cuda", {"distributed_executor_backend": "mp"}, False),
        ("cuda", {"speculative_config": '{"method": "ngram", "num_speculative_tokens": 2}'}, False),
    ],
)
def test_async_scheduling_is_on_by_default_on_cuda_where_it_combines(device, extra, expected):
    from minivllm.engine.arg_utils import EngineArgs
    from minivllm.engine.create_config import default_async_scheduling
    from minivllm.platforms import get_platform

    args = EngineArgs(model="m", **extra)
    assert args.async_scheduling is None  # unset: the device decides
    assert default_async_scheduling(args, get_platform(device)) is expected


def test_async_scheduling_off_by_default_on_the_cpu_and_asked_for_it_is_on(tiny_llama):
    from minivllm.engine.create_config import create_vllm_config

    config = create_vllm_config(EngineArgs(model=tiny_llama, device="cpu"))
    assert config.scheduler_config.async_scheduling is False
    config = create_vllm_config(EngineArgs(model=tiny_llama, device="cpu", async_scheduling=True))
    assert config.scheduler_config.async_scheduling is True
