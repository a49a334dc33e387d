"""`import minivllm` configures the `minivllm` logger as vLLM configures its own: INFO lines in
vLLM's format on stderr, from every process (the engine core's start-up lines too), unless
MINIVLLM_CONFIGURE_LOGGING=0. Run in fresh interpreters: the suite itself runs with it off."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import write_tiny_checkpoint

PROGRAM = """
import sys
from minivllm import LLM, SamplingParams
llm = LLM(sys.argv[1], max_model_len=64)
print(llm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].text)
"""


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, smollm2_tokenizer) -> str:
    folder = tmp_path_factory.mktemp("tiny-llama-logging")
    return write_tiny_checkpoint("llama", str(folder), smollm2_tokenizer)


def run(model: str, **env) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "MINIVLLM_CONFIGURE_LOGGING"}
    environ.update(env)
    return subprocess.run(
        [sys.executable, "-c", PROGRAM, model],
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_engine_core_process_logs_its_start_up_lines(tiny_llama):
    done = run(tiny_llama, MINIVLLM_ENABLE_MULTIPROCESSING="1")
    assert done.returncode == 0, done.stderr
    # Logged in the engine core's process (spawned), in vLLM's format.
    line = r"INFO \d\d-\d\d \d\d:\d\d:\d\d \[worker\.py:\d+\] Model weights: [\d.]+ MiB"
    assert re.search(line, done.stderr), done.stderr


def test_off_leaves_logging_to_the_application(tiny_llama):
    done = run(tiny_llama, MINIVLLM_CONFIGURE_LOGGING="0")
    assert done.returncode == 0, done.stderr
    assert "Model weights" not in done.stderr
