"""Hub names resolve in the local Hugging Face cache, offline, or fail saying where to put files."""

from __future__ import annotations

import os

import pytest

from minivllm.model.hf_cache import resolve_model_name


def make_snapshot(cache: str, repo: str, revision: str, files: dict[str, str]) -> str:
    repo_dir = os.path.join(cache, "models--" + repo.replace("/", "--"))
    snapshot = os.path.join(repo_dir, "snapshots", revision)
    os.makedirs(snapshot)
    for name, text in files.items():
        with open(os.path.join(snapshot, name), "w") as f:
            f.write(text)
    return snapshot


def test_a_cached_name_resolves_to_the_snapshot_refs_main_names(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    cache = os.path.join(tmp_path, "hub")
    old = make_snapshot(cache, "facebook/opt-125m", "aaa", {"config.json": "{}"})
    new = os.path.join(os.path.dirname(old), "bbb")
    os.makedirs(new)
    open(os.path.join(new, "config.json"), "w").close()
    os.makedirs(os.path.join(cache, "models--facebook--opt-125m", "refs"))
    with open(os.path.join(cache, "models--facebook--opt-125m", "refs", "main"), "w") as f:
        f.write("aaa")
    assert resolve_model_name("facebook/opt-125m") == old


def test_hf_hub_cache_wins_and_a_lone_gguf_is_the_model(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    snapshot = make_snapshot(str(tmp_path), "org/m-GGUF", "r1", {"m.Q4_K_M.gguf": ""})
    assert resolve_model_name("org/m-GGUF") == os.path.join(snapshot, "m.Q4_K_M.gguf")


def test_local_paths_and_none_pass_through(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    os.makedirs("facebook/opt-125m")
    assert resolve_model_name("facebook/opt-125m") == "facebook/opt-125m"
    assert resolve_model_name(None) is None
    assert resolve_model_name("/no/such/dir") == "/no/such/dir"  # the loader reports it


def test_a_missing_name_fails_at_once_saying_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(FileNotFoundError) as info:
        resolve_model_name("facebook/opt-125m")
    message = str(info.value)
    assert os.path.join(str(tmp_path), "hub", "models--facebook--opt-125m") in message
    assert "huggingface-cli download facebook/opt-125m" in message
    assert "HF_HOME" in message


def test_llm_with_an_uncached_name_fails_before_any_network_use(tmp_path, monkeypatch):
    import socket

    from minivllm import LLM

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))

    def no_network(*args, **kwargs):
        raise AssertionError("tried to open a network connection")

    monkeypatch.setattr(socket, "create_connection", no_network)
    with pytest.raises(FileNotFoundError, match="models--facebook--opt-125m"):
        LLM("facebook/opt-125m")
