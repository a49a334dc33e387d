"""The seeds' programs in examples/seeds/ run as written (only `vllm` became `minivllm`), on
tiny checkpoints placed where the programs look: ~/workspace/..., ./workspace/..., and the
Hugging Face cache for facebook/opt-125m."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import write_tiny_checkpoint
from tests.entrypoints.openai.utils import RemoteServer, post_json
from tests.model.sources.fake_hub import FakeHub

pytestmark = pytest.mark.e2e

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEEDS = os.path.join(ROOT, "examples", "seeds")
TIMEOUT_S = 300

# Seed 003's server flags (its --gpu-memory-utilization line included).
SEED_003_FLAGS = [
    "--model", "facebook/opt-125m",
    "--tensor-parallel-size", "1",
    "--max-num-seqs", "500",
    "--trust-remote-code",
    "--enforce-eager",
    "--max-num-batched-tokens", "512",
    "--enable-chunked-prefill",
    "--gpu-memory-utilization", "0.02",
]  # fmt: skip
SEED_003_BODY = {
    "model": "facebook/opt-125m",
    "messages": [
        {
            "role": "user",
            "content": "1 u are loved, sir: They that least lend it you shall lack you first. "
            "KING I fill a place",
        }
    ],
    "temperature": 0.7,
    "length_penalty": 1.0,
    "max_tokens": 100,
    "min_tokens": 100,
    "is_latency_sensitive": "True",
    "slo": 0.05,
}


@pytest.fixture(scope="module")
def fake_hub(tiny_opt):
    """A local Hub (HF_ENDPOINT) that serves the tiny OPT as facebook/opt-125m."""
    hub = FakeHub()
    hub.add_repo("facebook/opt-125m", {f: os.path.join(tiny_opt, f) for f in os.listdir(tiny_opt)})
    hub.start()
    yield hub
    hub.stop()


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory, smollm2_tokenizer) -> str:
    folder = tmp_path_factory.mktemp("tiny-qwen3")
    return write_tiny_checkpoint("qwen3", str(folder), smollm2_tokenizer)


def run_program(args: list[str], env: dict[str, str] | None = None, cwd: str | None = None):
    full_env = {**os.environ, "MINIVLLM_CPU_KVCACHE_SPACE": "0.25", **(env or {})}
    full_env["PYTHONPATH"] = ROOT + os.pathsep + full_env.get("PYTHONPATH", "")
    done = subprocess.run(
        [sys.executable, *args],
        env=full_env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_seed_001_basic_downloads_opt_125m_once_then_loads_it(fake_hub, tmp_path):
    env = {"HF_HOME": str(tmp_path), "HF_ENDPOINT": fake_hub.url, "HF_HUB_OFFLINE": ""}
    out = run_program([os.path.join(SEEDS, "basic.py")], env=env)
    assert out.count("Generated text:") == 4
    assert "Prompt: 'The capital of France is'" in out
    downloads = len(fake_hub.requests)
    assert downloads > 0
    out = run_program([os.path.join(SEEDS, "basic.py")], env=env)  # the second start
    assert out.count("Generated text:") == 4 and len(fake_hub.requests) == downloads


def test_seed_000_offline_inference(tmp_path, tiny_qwen3):
    shutil.copytree(tiny_qwen3, tmp_path / "workspace" / "Qwen3-0.6B")
    out = run_program(
        [os.path.join(SEEDS, "offline_inference_qwen3.py")], env={"HOME": str(tmp_path)}
    )
    assert "Prompt: Hello, my name is" in out
    assert "Output: " in out


def test_seed_000_llm_engine_example(tiny_opt):
    out = run_program([os.path.join(SEEDS, "llm_engine_example.py"), "--model", tiny_opt])
    # Three prompts, the last with n=2: every request finishes.
    assert out.count("finished=True") >= 3
    assert "A robot may not injure a human being" in out


def test_seed_000_async_llm_streaming(tmp_path, tiny_qwen3):
    shutil.copytree(tiny_qwen3, tmp_path / "workspace" / "qwen3-30m-fp16")
    out = run_program([os.path.join(SEEDS, "async_llm_streaming.py")], cwd=str(tmp_path))
    assert out.count("Generation complete!") == 3


CLIENT_RUNNER = """
import runpy, sys
import openai
base_url = sys.argv[2]
real = openai.AsyncOpenAI
# The program's text is unchanged; only its hard-coded localhost:8000 becomes the test port.
openai.AsyncOpenAI = lambda **kwargs: real(**{**kwargs, "base_url": base_url})
runpy.run_path(sys.argv[1], run_name="__main__")
"""


def test_seed_003_servers_curl_and_client(fake_hub, tmp_path):
    env = {"HF_HOME": str(tmp_path), "HF_ENDPOINT": fake_hub.url, "HF_HUB_OFFLINE": ""}
    # The seed-000 client asks for workspace/qwen3-30m-fp16/: a second name for the model.
    names = ["--served-model-name", "facebook/opt-125m", "workspace/qwen3-30m-fp16/"]
    server = RemoteServer(
        [*SEED_003_FLAGS, *names], env=env, module="minivllm.entrypoints.openai.api_server"
    )
    try:
        curl = subprocess.run(
            ["curl", "-sS", "-f", server.url_for("v1", "chat", "completions"),
             "-H", "Content-Type: application/json", "-d", json.dumps(SEED_003_BODY)],
            capture_output=True, text=True, timeout=TIMEOUT_S,
        )  # fmt: skip
        assert curl.returncode == 0, curl.stderr
        answer = json.loads(curl.stdout)
        assert answer["model"] == "facebook/opt-125m"
        assert answer["usage"]["completion_tokens"] == 100  # min_tokens = max_tokens = 100
        assert "ignored: is_latency_sensitive" not in server.log_text()  # honoured (SLO)
        out = run_program(
            ["-c", CLIENT_RUNNER, os.path.join(SEEDS, "openai_chat_stream_client.py"),
             server.url_for("v1")],
        )  # fmt: skip
        assert all(f"[#{i}] <<< done" in out for i in range(3))
    finally:
        server.stop()
    demo = RemoteServer(SEED_003_FLAGS, env=env, module="minivllm.entrypoints.api_server")
    try:
        status, answer = post_json(
            demo.url_for("generate"), {"prompt": "Hello", "max_tokens": 4, "temperature": 0}
        )
        assert status == 200, answer
        assert answer["text"][0].startswith("Hello")
    finally:
        demo.stop()
