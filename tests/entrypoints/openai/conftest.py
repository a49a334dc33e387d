"""One real server for the OpenAI API tests of this folder (those needing other flags start
their own)."""

from __future__ import annotations

import pytest

from tests.entrypoints.openai.utils import RemoteServer

MODEL_NAME = "smollm"
MODEL_ALIAS = "smollm-alias"
MAX_MODEL_LEN = 256
SERVER_ARGS = [
    "--max-model-len", str(MAX_MODEL_LEN),
    "--served-model-name", MODEL_NAME, MODEL_ALIAS,
    "--log-stats-interval", "1",
]  # fmt: skip


@pytest.fixture(scope="session")
def server():
    remote = RemoteServer(SERVER_ARGS)
    yield remote
    remote.stop()


@pytest.fixture(scope="session")
def client(server):
    return server.get_client()


@pytest.fixture(scope="session")
def offline_llm():
    """The offline engine on the same model: the reference for greedy parity."""
    from minivllm import LLM

    llm = LLM(max_model_len=MAX_MODEL_LEN)
    yield llm
    llm.llm_engine.shutdown()
