"""``ollama:`` and ``lmstudio:`` names serve the GGUF files those apps keep, in place."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest

from minivllm.model.sources import ModelSourceError, resolve_model_source
from minivllm.model.sources.ollama import ollama_parameters


def make_ollama_store(root, name: str, tag: str, blob: bytes, params: dict | None = None) -> str:
    """An Ollama store as `ollama pull` leaves it: the manifest and its blobs."""
    blobs = root / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)

    def put(data: bytes, media_type: str) -> dict:
        digest = hashlib.sha256(data).hexdigest()
        (blobs / f"sha256-{digest}").write_bytes(data)
        return {"mediaType": media_type, "digest": f"sha256:{digest}", "size": len(data)}

    layers = [put(blob, "application/vnd.ollama.image.model")]
    layers.append(put(b"{{ .Prompt }}", "application/vnd.ollama.image.template"))
    if params is not None:
        layers.append(put(json.dumps(params).encode(), "application/vnd.ollama.image.params"))
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": put(b"{}", "application/vnd.docker.container.image.v1+json"),
        "layers": layers,
    }
    folder = root / "manifests" / "registry.ollama.ai" / "library" / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / tag).write_text(json.dumps(manifest))
    return str(blobs / f"sha256-{hashlib.sha256(blob).hexdigest()}")


def make_ollama_store_from_file(
    root, name: str, tag: str, gguf: str, params: dict | None = None
) -> str:
    """The same store with a real GGUF file as its model blob (hard-linked where the file
    system allows, else copied)."""
    blob = make_ollama_store(root, name, tag, b"placeholder", params)
    h = hashlib.sha256()
    with open(gguf, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    digest = h.hexdigest()
    real = os.path.join(os.path.dirname(blob), f"sha256-{digest}")
    try:
        os.link(gguf, real)
    except OSError:
        shutil.copyfile(gguf, real)
    manifest_path = root / "manifests" / "registry.ollama.ai" / "library" / name / tag
    manifest = json.loads(manifest_path.read_text())
    manifest["layers"][0]["digest"] = f"sha256:{digest}"
    manifest_path.write_text(json.dumps(manifest))
    os.remove(blob)
    return real


@pytest.fixture
def stores(tmp_path, monkeypatch):
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama"))
    monkeypatch.setenv("MINIVLLM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path


def test_an_ollama_name_is_its_blob_in_place(stores):
    blob = make_ollama_store(stores / "ollama", "qwen3", "4b", b"GGUF" + os.urandom(1000))
    path = resolve_model_source("ollama:qwen3:4b")
    assert path.endswith(".gguf") and os.path.realpath(path) == os.path.realpath(blob)
    assert os.path.islink(path)  # no second copy of the weights
    assert resolve_model_source("ollama:qwen3:4b") == path  # the same link again


def test_the_tag_defaults_to_latest_and_parameters_are_read(stores):
    make_ollama_store(stores / "ollama", "smol", "latest", b"GGUF", params={"temperature": 0.3})
    assert resolve_model_source("ollama:smol").endswith(".gguf")
    assert ollama_parameters("smol") == {"temperature": 0.3}


@pytest.mark.parametrize("name", ["ollama:nothere:1b", "ollama:../../etc:x", "ollama:a/b/c/d"])
def test_an_unknown_or_malformed_ollama_name_fails_in_one_line(stores, name):
    with pytest.raises(ModelSourceError) as info:
        resolve_model_source(name)
    assert "\n" not in str(info.value)


def test_an_lmstudio_name_is_its_file_in_place(stores):
    repo = stores / "home" / ".lmstudio" / "models" / "lmstudio-community" / "Qwen3-4B-GGUF"
    repo.mkdir(parents=True)
    for quant in ("Q4_K_M", "Q8_0"):
        (repo / f"Qwen3-4B-{quant}.gguf").write_bytes(b"GGUF")
    (repo / "mmproj-Qwen3-4B-F16.gguf").write_bytes(b"GGUF")
    name = "lmstudio:lmstudio-community/Qwen3-4B-GGUF"
    assert resolve_model_source(name + ":q8_0") == str(repo / "Qwen3-4B-Q8_0.gguf")
    with pytest.raises(ModelSourceError, match="holds 2 GGUF files"):
        resolve_model_source(name)
    with pytest.raises(ModelSourceError, match="has no model"):
        resolve_model_source("lmstudio:nobody/nothing")


def test_lmstudio_settings_move_the_models_folder(stores):
    elsewhere = stores / "elsewhere" / "pub" / "m"
    elsewhere.mkdir(parents=True)
    (elsewhere / "m-Q4_0.gguf").write_bytes(b"GGUF")
    settings = stores / "home" / ".lmstudio" / "settings.json"
    settings.parent.mkdir(parents=True)
    settings.write_text(json.dumps({"downloadsFolder": str(stores / "elsewhere")}))
    assert resolve_model_source("lmstudio:pub/m") == str(elsewhere / "m-Q4_0.gguf")


def test_an_ollama_models_parameters_are_its_serving_defaults(stores, smollm2_path):
    """The manifest's sampling parameters become the defaults (as a generation_config.json's)
    and its num_ctx the context length; the user's options win over both."""
    from minivllm.engine.arg_utils import EngineArgs
    from minivllm.engine.create_config import create_vllm_config

    params = {
        "temperature": 0.6, "top_k": 20, "top_p": 0.95, "repeat_penalty": 1.1,
        "stop": ["<|im_end|>"], "num_ctx": 1024, "num_predict": -1, "mirostat": 2,
    }  # fmt: skip
    make_ollama_store_from_file(stores / "ollama", "smol", "latest", smollm2_path, params)
    config = create_vllm_config(EngineArgs(model="ollama:smol")).model_config
    assert config.max_model_len == 1024
    assert config.get_diff_sampling_param() == {
        "temperature": 0.6, "top_k": 20, "top_p": 0.95, "repetition_penalty": 1.1,
        "stop": ["<|im_end|>"],
    }  # fmt: skip
    args = EngineArgs(
        model="ollama:smol", max_model_len=512, override_generation_config={"temperature": 0.1}
    )
    config = create_vllm_config(args).model_config
    assert config.max_model_len == 512
    assert config.get_diff_sampling_param()["temperature"] == 0.1
    assert config.get_diff_sampling_param()["top_k"] == 20
    args = EngineArgs(model="ollama:smol", generation_config="vllm")
    assert create_vllm_config(args).model_config.get_diff_sampling_param() == {}
