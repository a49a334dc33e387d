import pytest


@pytest.fixture
def mixed_steps(monkeypatch):
    """vLLM's steps: running decodes in every one, beside new prompts (MINIVLLM_PREFILL_FIRST=0).
    For tests that spell out a schedule of that policy."""
    monkeypatch.setenv("MINIVLLM_PREFILL_FIRST", "0")
