"""`minivllm chat` and `minivllm complete` in a pseudo-terminal (pexpect) against a real
`minivllm serve`: a kept conversation, Ctrl-C that stops an answer but not the program,
and --quick."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from tests.entrypoints.openai.utils import RemoteServer, metrics

pexpect = pytest.importorskip("pexpect")

pytestmark = pytest.mark.e2e

API_KEY = "cli-key"
MODEL_NAME = "smollm"
WAIT_S = 120


@pytest.fixture(scope="module")
def server():
    remote = RemoteServer(
        ["--api-key", API_KEY, "--max-model-len", "512", "--served-model-name", MODEL_NAME]
    )
    yield remote
    remote.stop()


def _metric(server: RemoteServer, name: str, label: str = "") -> float:
    return sum(v for k, v in metrics(server).items() if k.startswith(name) and label in k)


def _wait_for(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _spawn(server: RemoteServer, command: str, *args: str):
    argv = ["-m", "minivllm.entrypoints.cli", command, "--url", server.url_root]
    argv += ["--api-key", API_KEY, *args]
    # Ctrl-C at its default: a shell without job control starts `cmd &` with SIGINT ignored,
    # the ignore is inherited down to this child, and Python then never raises
    # KeyboardInterrupt (the Ctrl-C test failed only where pytest ran so).
    child = pexpect.spawn(
        sys.executable,
        argv,
        encoding="utf-8",
        timeout=WAIT_S,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    child.setwinsize(40, 200)
    return child


QUESTION = "What is the capital of France?"


def test_chat_keeps_the_conversation(server):
    child = _spawn(server, "chat", "--temperature", "0", "--max-tokens", "16",
                   "--system-prompt", "You are a helpful assistant.")  # fmt: skip
    try:
        child.expect(f"Chatting with {MODEL_NAME}")
        child.expect_exact("> ")
        # Two turns of the same question: the second prompt holds the first turn too.
        prompt_tokens = []
        for _ in range(2):
            before = _metric(server, "vllm:prompt_tokens_total")
            child.sendline(QUESTION)
            child.expect_exact("> ")
            answer = child.before.split("\n", 1)[1].strip()  # after the echoed question
            assert answer and "error" not in answer, child.before
            _wait_for(lambda b=before: _metric(server, "vllm:prompt_tokens_total") > b,
                      "the prompt tokens to be counted")  # fmt: skip
            prompt_tokens.append(_metric(server, "vllm:prompt_tokens_total") - before)
        # The second prompt = the first + the first answer + the question again (each
        # message with its template tokens).
        assert prompt_tokens[1] > prompt_tokens[0] + 10, prompt_tokens
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0


def test_ctrl_c_stops_the_answer_not_the_program(server):
    # A long answer (EOS ignored) that Ctrl-C stops once it is being written.
    child = _spawn(server, "chat", "--max-tokens", "400", "--extra-body", '{"ignore_eos": true}')
    try:
        child.expect_exact("> ")
        aborted = _metric(server, "vllm:request_success_total", 'finished_reason="abort"')
        child.sendline("Tell me a long story about a dragon.")
        child.expect_exact("dragon.\r\n")  # the echoed line
        child.expect(r"\S")  # the answer has started
        child.sendintr()
        child.expect_exact("[stopped]")
        child.expect_exact("> ")
        _wait_for(
            lambda: (
                _metric(server, "vllm:request_success_total", 'finished_reason="abort"') > aborted
            ),
            "/metrics to count the abort",
        )
        assert child.isalive()
        # Still chatting after the stop (the stopped answer is in the history); Ctrl-C at
        # the prompt quits.
        child.sendline("Stop.")
        child.expect_exact("Stop.\r\n")
        child.expect(r"\S")
        child.sendintr()
        child.expect_exact("> ")
        assert "error" not in child.before
        child.sendintr()
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0


def test_quick_answers_once_and_exits(server):
    base = [sys.executable, "-m", "minivllm.entrypoints.cli"]
    common = ["--url", server.url_for("v1"), "--api-key", API_KEY, "--max-tokens", "8"]
    for command, message, sensitive in (
        ("chat", "Say hello.", 1),  # a person waits on a chat: latency-sensitive
        ("complete", "The capital of France is", 0),
    ):
        before = _metric(server, "minivllm:slo_requests_total", "latency_sensitive")
        done = subprocess.run(
            [*base, command, *common, "--quick", message],
            capture_output=True, text=True, timeout=WAIT_S,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip(), command
        after = _metric(server, "minivllm:slo_requests_total", "latency_sensitive")
        assert after - before == sensitive, command


def test_a_wrong_key_is_an_error_not_a_traceback(server):
    done = subprocess.run(
        [sys.executable, "-m", "minivllm.entrypoints.cli", "chat", "--url", server.url_root,
         "--api-key", "wrong", "--quick", "hi"],
        capture_output=True, text=True, timeout=WAIT_S,
    )  # fmt: skip
    assert done.returncode == 1
    assert "401" in done.stderr and "Traceback" not in done.stderr
