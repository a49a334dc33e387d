"""`minivllm serve` on a Hub checkpoint and a Hub GGUF repo's quantization (from a local fake
Hub) and on an Ollama store's model, each served and answering; a second start, with the Hub
gone, serves the cached copy."""

from __future__ import annotations

import os

import openai
import pytest

from tests.entrypoints.openai.utils import RemoteServer
from tests.model.sources.fake_hub import FakeHub
from tests.model.sources.test_local_stores import make_ollama_store_from_file

pytestmark = pytest.mark.e2e


def ask(server: RemoteServer, model: str) -> str:
    client = openai.OpenAI(base_url=server.url_for("v1"), api_key="none")
    assert [m.id for m in client.models.list().data] == [model]
    reply = client.completions.create(model=model, prompt="Hello", max_tokens=4, temperature=0)
    return reply.choices[0].text


def test_serve_a_gguf_repo_quantization_from_the_hub(tmp_path, smollm2_path):
    hub = FakeHub()
    hub.add_repo("org/smol-GGUF", {"smol.Q4_1.gguf": smollm2_path, "smol.Q8_0.gguf": smollm2_path})
    hub.start()
    env = {"HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": ""}
    try:
        args = ["org/smol-GGUF:Q4_1", "--max-model-len", "1024"]
        server = RemoteServer([*args, "--download-dir", str(tmp_path / "models")], env=env)
        try:
            first = ask(server, "org/smol-GGUF:Q4_1")
        finally:
            server.stop()
        assert hub.requests == ["GET org/smol-GGUF/smol.Q4_1.gguf from 0"]
    finally:
        hub.stop()
    env["HF_ENDPOINT"] = "http://127.0.0.1:9"  # the Hub is gone: the cache serves
    env["HF_HUB_CACHE"] = str(tmp_path / "models")
    args = ["org/smol-GGUF", "--hf-file", "smol.Q4_1.gguf", "--max-model-len", "1024"]
    server = RemoteServer(args, env=env)
    try:
        assert ask(server, "org/smol-GGUF") == first
    finally:
        server.stop()


def test_serve_a_hub_checkpoint_downloads_it_once(tmp_path, tiny_opt):
    hub = FakeHub()
    hub.add_repo(
        "org/tiny-opt", {name: os.path.join(tiny_opt, name) for name in os.listdir(tiny_opt)}
    )
    hub.start()
    env = {"HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": ""}
    args = ["org/tiny-opt", "--max-model-len", "256"]
    try:
        server = RemoteServer(args, env=env)
        try:
            first = ask(server, "org/tiny-opt")
        finally:
            server.stop()
        assert "GET org/tiny-opt/config.json from 0" in hub.requests
    finally:
        hub.stop()
    env["HF_ENDPOINT"] = "http://127.0.0.1:9"  # the Hub is gone: the cache serves
    server = RemoteServer(args, env=env)
    try:
        assert ask(server, "org/tiny-opt") == first
    finally:
        server.stop()


def test_serve_an_ollama_model_in_place(tmp_path, smollm2_path):
    tag = os.path.basename(tmp_path)  # a tag of this run's own: the link it makes is its own
    blob = make_ollama_store_from_file(tmp_path / "ollama", "smol", tag, smollm2_path)
    # The blob is a hard link to the bundled file, as are the links of earlier runs that
    # pytest keeps in its temporary folders: count this run's links only.
    links = os.stat(blob).st_nlink
    server = RemoteServer(
        [f"ollama:smol:{tag}", "--max-model-len", "1024"],
        env={"OLLAMA_MODELS": str(tmp_path / "ollama")},
    )
    try:
        assert ask(server, f"ollama:smol:{tag}")
    finally:
        server.stop()
    assert os.stat(blob).st_nlink == links  # served in place: the server linked nothing
