"""A many-model server's pieces that need no engine: the models found below --models-dir,
the --model NAME=SOURCE flag, Ollama's keep_alive, and the metrics merged across models."""

from __future__ import annotations

import argparse
import os

import pytest

from minivllm.entrypoints.openai.model_catalog import (
    estimated_weight_bytes,
    model_catalog,
    parse_model_spec,
    scan_models_dir,
)
from minivllm.entrypoints.openai.model_router_middleware import parse_keep_alive


def _touch(path: str, size: int = 1) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(b"\0" * size)


def test_models_dir_names_files_by_stem_and_folders_by_name(tmp_path):
    root = str(tmp_path)
    _touch(f"{root}/chat.gguf")
    _touch(f"{root}/sub/coder-Q4_K_M.gguf")
    _touch(f"{root}/big-00001-of-00002.gguf", 10)
    _touch(f"{root}/big-00002-of-00002.gguf", 20)
    _touch(f"{root}/mmproj-vision.gguf")
    _touch(f"{root}/embedder/config.json")
    _touch(f"{root}/embedder/model.safetensors", 30)
    _touch(f"{root}/embedder/nested/other.gguf")  # inside a checkpoint: not a model
    found = scan_models_dir(root)
    assert found == {
        "big": f"{root}/big-00001-of-00002.gguf",
        "chat": f"{root}/chat.gguf",
        "coder-Q4_K_M": f"{root}/sub/coder-Q4_K_M.gguf",
        "embedder": f"{root}/embedder",
    }
    assert estimated_weight_bytes(found["big"]) == 30  # both parts
    assert estimated_weight_bytes(found["embedder"]) == 30
    assert estimated_weight_bytes("org/hub-model") == 0


def test_two_models_with_one_name_are_refused(tmp_path):
    _touch(f"{tmp_path}/a/m.gguf")
    _touch(f"{tmp_path}/b/m.gguf")
    with pytest.raises(ValueError, match="two models are named 'm'"):
        scan_models_dir(str(tmp_path))


def test_named_models_join_the_folder_and_clash_by_name(tmp_path):
    _touch(f"{tmp_path}/m.gguf")
    catalog = model_catalog(str(tmp_path), [("coder", "ollama:qwen2.5-coder")])
    assert catalog == {"m": f"{tmp_path}/m.gguf", "coder": "ollama:qwen2.5-coder"}
    with pytest.raises(ValueError, match="already served"):
        model_catalog(str(tmp_path), [("m", "org/other")])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="holds no GGUF"):
        model_catalog(str(empty), [])


def test_model_spec_is_name_equals_source_and_a_plain_model_is_not(tmp_path):
    assert parse_model_spec("chat=/models/a.gguf") == ("chat", "/models/a.gguf")
    assert parse_model_spec("coder=ollama:qwen2.5-coder:7b") == ("coder", "ollama:qwen2.5-coder:7b")
    assert parse_model_spec("org/name") is None
    assert parse_model_spec("/models/x.gguf") is None
    weird = tmp_path / "a=b.gguf"
    weird.write_bytes(b"")
    assert parse_model_spec(str(weird)) is None  # an existing path stays a path
    with pytest.raises(ValueError, match="needs a source"):
        parse_model_spec("chat=")


def test_serve_flags_take_model_specs_beside_the_one_model_form():
    from minivllm.entrypoints.openai.cli_args import engine_args_from, make_arg_parser
    from minivllm.entrypoints.openai.model_router_args import is_many_models, router_config_from

    parser = make_arg_parser(argparse.ArgumentParser())
    one = parser.parse_args(["--model", "org/name"])
    assert not is_many_models(one) and engine_args_from(one).model == "org/name"
    many = parser.parse_args(
        ["--model", "a=/x/a.gguf", "--model", "b=org/b", "--models-memory", "1.5",
         "--max-loaded-models", "2", "--keep-alive", "30"]
    )  # fmt: skip
    assert is_many_models(many) and many.model is None
    config = router_config_from(many)
    assert config.catalog == {"a": "/x/a.gguf", "b": "org/b"}
    assert config.memory_bytes == int(1.5 * (1 << 30))
    assert (config.max_loaded_models, config.keep_alive_s) == (2, 30.0)
    with pytest.raises(ValueError, match="MODEL cannot be given"):
        router_config_from(parser.parse_args(["some-model", "--model", "a=/x/a.gguf"]))
    with pytest.raises(ValueError, match="--lora-modules adapt one base model"):
        router_config_from(parser.parse_args(["--model", "a=/x", "--lora-modules", "l=/y"]))
    with pytest.raises(ValueError, match="--models-memory must be positive"):
        router_config_from(parser.parse_args(["--model", "a=/x", "--models-memory", "0"]))


@pytest.mark.parametrize(
    ("value", "seconds"),
    [(None, None), (0, 0.0), (30, 30.0), ("10", 10.0), ("5m", 300.0), ("1h30m", 5400.0),
     ("250ms", 0.25), (-1, float("inf")), ("-1m", float("inf")), ("soon", None), (True, None)],
)  # fmt: skip
def test_ollama_keep_alive_in_seconds(value, seconds):
    assert parse_keep_alive(value) == seconds


def test_metrics_of_several_models_merge_into_one_family_each():
    from minivllm.entrypoints.openai.many_models_server import RouterMetrics
    from minivllm.metrics.loggers import PrometheusStatLogger

    loggers = {name: PrometheusStatLogger(name, 512) for name in ("a", "b")}
    loaded = [
        argparse.Namespace(
            state=argparse.Namespace(stat_loggers=argparse.Namespace(prometheus=logger))
        )
        for logger in loggers.values()
    ]
    router = argparse.Namespace(loaded=lambda: loaded)
    text = RouterMetrics(router).render().decode()
    assert text.count("# TYPE vllm:num_requests_running gauge") == 1
    assert 'vllm:num_requests_running{engine="0",model_name="a"}' in text
    assert 'vllm:num_requests_running{engine="0",model_name="b"}' in text
    assert "minivllm:loaded_models 2.0" in text


def test_model_load_and_unload_are_behind_the_api_key():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from minivllm.entrypoints.openai.errors import add_exception_handlers
    from minivllm.entrypoints.openai.middleware import APIKeyMiddleware
    from minivllm.entrypoints.openai.routes import models

    app = FastAPI()
    app.include_router(models.router)
    add_exception_handlers(app)
    app.add_middleware(APIKeyMiddleware, api_key="k")
    client = TestClient(app)
    for path in ("/models/load", "/models/unload"):
        assert client.post(path, json={"model": "a"}).status_code == 401
        # With the key it reaches the route, which a one-model server answers with a 404.
        answer = client.post(path, json={"model": "a"}, headers={"Authorization": "Bearer k"})
        assert answer.status_code == 404
