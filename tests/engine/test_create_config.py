"""Rules of engine/create_config.py that need no model: the default sampling parameters."""

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
