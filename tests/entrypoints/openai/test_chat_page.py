"""The chat page at / in a real headless browser (Debian's chromium, driven by selenium
through its chromedriver) against a real `minivllm serve` that has an API key: the page
asks for the key, streams an answer, and its Stop button aborts the request in the
engine, which /metrics counts. A screenshot is written to test-artifacts/."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import time
from pathlib import Path

import pytest

from tests.entrypoints.openai.utils import RemoteServer, metrics, request

pytestmark = pytest.mark.e2e

API_KEY = "chat-page-key"
MODEL_NAME = "smollm"
# Kept after the run (and ignored by git), for a person to look at.
ARTIFACTS = Path(
    os.environ.get("MINIVLLM_TEST_ARTIFACTS", Path(__file__).parents[3] / "test-artifacts")
)
WAIT_S = 120.0


def _find(*names: str) -> str | None:
    return next((path for name in names if (path := shutil.which(name))), None)


@pytest.fixture(scope="module")
def server():
    remote = RemoteServer(
        ["--api-key", API_KEY, "--max-model-len", "512", "--served-model-name", MODEL_NAME]
    )
    yield remote
    remote.stop()


@pytest.fixture(scope="module")
def browser():
    webdriver = pytest.importorskip("selenium.webdriver")
    chromium = _find("chromium", "chromium-browser", "google-chrome")
    driver_path = _find("chromedriver")
    if chromium is None or driver_path is None:
        pytest.skip("needs chromium and chromedriver (`make install` installs them with apt)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--window-size=1200,900"):  # fmt: skip
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(driver_path))
    yield driver
    driver.quit()


def _wait(condition, what: str, timeout: float = WAIT_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _aborted(server: RemoteServer) -> float:
    return sum(
        value
        for key, value in metrics(server).items()
        if key.startswith("vllm:request_success_total") and 'finished_reason="abort"' in key
    )


def _last_answer(driver):
    from selenium.webdriver.common.by import By

    answers = driver.find_elements(By.CSS_SELECTOR, ".message.assistant")
    return answers[-1] if answers else None


def _set(driver, element_id: str, value: str) -> None:
    field = driver.find_element("id", element_id)
    field.clear()
    field.send_keys(value)


def _ask(driver, question: str) -> None:
    from selenium.webdriver.common.keys import Keys

    count = len(driver.find_elements("css selector", ".message.assistant"))
    driver.find_element("id", "prompt").send_keys(question, Keys.ENTER)
    _wait(lambda: len(driver.find_elements("css selector", ".message.assistant")) > count,
          "the answer to appear")  # fmt: skip


def test_chat_page_streams_and_stops(server, browser):
    driver = browser
    driver.get(server.url_root + "/")

    # The server has a key: the page asks for it before anything else.
    dialog = driver.find_element("id", "api-key-dialog")
    _wait(lambda: dialog.get_attribute("open") is not None, "the API key dialog")
    _set(driver, "api-key", API_KEY)
    driver.find_element("id", "api-key-save").click()
    _wait(lambda: driver.find_element("id", "model-name").text == MODEL_NAME, "the model name")

    # A short greedy answer runs to its end and shows its speed.
    driver.find_element("id", "toggle-settings").click()
    _set(driver, "system-prompt", "You are a concise assistant.")
    _set(driver, "temperature", "0")
    _set(driver, "max_tokens", "12")
    _ask(driver, "What is the capital of France?")
    answer = _last_answer(driver)
    _wait(lambda: "done" in answer.get_attribute("class"), "the first answer to finish")
    assert answer.find_element("css selector", ".content").text.strip()
    stats = answer.find_element("css selector", ".stats").text
    assert re.match(r"\d+ tokens · [0-9.]+ tokens/s", stats), stats

    # A long answer (EOS ignored) streams in; Stop aborts it mid-way.
    _set(driver, "max_tokens", "400")
    _set(driver, "extra-body", '{"ignore_eos": true}')
    aborted_before = _aborted(server)
    _ask(driver, "Tell me a long story about a dragon.")
    answer = _last_answer(driver)
    content = answer.find_element("css selector", ".content")
    first = _wait(lambda: content.text.strip(), "the first streamed words")
    _wait(lambda: len(content.text.strip()) > len(first), "more streamed words")
    assert "streaming" in answer.get_attribute("class")
    driver.find_element("id", "stop").click()
    _wait(lambda: "stopped" in answer.get_attribute("class"), "the answer to stop")
    assert "stopped" in answer.find_element("css selector", ".stats").text
    _wait(lambda: _aborted(server) > aborted_before, "/metrics to count the abort", 30)
    assert driver.find_element("id", "stop").get_attribute("hidden") is not None
    assert driver.find_element("id", "send").is_enabled()
    stopped_text = content.text
    time.sleep(1.0)
    assert content.text == stopped_text  # nothing more arrives after Stop

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    assert driver.save_screenshot(str(ARTIFACTS / "chat_page.png"))


def test_markdown_renderer_in_the_browser(server, browser):
    driver = browser
    driver.get(server.url_root + "/")
    # The key as the page keeps it, so that no dialog covers the screenshot.
    driver.execute_script("localStorage.setItem('minivllm-chat-api-key', arguments[0])", API_KEY)
    driver.refresh()
    html = driver.execute_script(
        "return Markdown.render(arguments[0]);",
        "# Title\nSome **bold** and `x<y` <script>alert(1)</script>\n\n- one\n- two\n\n"
        "```python\nprint('<b>')\n```\n[ok](https://example.com) [bad](javascript:alert(1))",
    )
    assert "<h1>Title</h1>" in html
    assert "<strong>bold</strong>" in html and "<code>x&lt;y</code>" in html
    assert "<script>" not in html and "&lt;script&gt;" in html
    assert "<ul><li>one</li><li>two</li></ul>" in html
    assert 'class="language-python">print(&#39;&lt;b&gt;&#39;)</code>' in html
    assert '<a href="https://example.com"' in html and 'href="javascript' not in html

    # How an answer with code looks, for a person to check (test-artifacts/).
    driver.execute_script(
        "addMessage('user', 'Show me a Python function.');addMessage('assistant', arguments[0]);",
        "Here is **one**:\n\n```python\ndef square(x: int) -> int:\n    return x * x\n```\n\n"
        "1. It takes `x`.\n2. It returns *x squared*.\n\n> Quoted text.",
    )
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    assert driver.save_screenshot(str(ARTIFACTS / "chat_page_markdown.png"))


def test_disable_chat_page_leaves_only_the_api():
    from fastapi.testclient import TestClient

    from minivllm.entrypoints.openai.api_server import build_app
    from minivllm.entrypoints.openai.cli_args import make_arg_parser

    def client(*flags: str) -> TestClient:
        args = make_arg_parser(argparse.ArgumentParser()).parse_args(list(flags))
        return TestClient(build_app(args))

    on = client()
    page = on.get("/")
    assert page.status_code == 200 and "minivllm chat" in page.text
    assert on.get("/static/chat.js").status_code == 200
    off = client("--disable-chat-page")
    assert off.get("/").status_code == 404
    assert off.get("/static/chat.js").status_code == 404


def test_chat_page_needs_no_key(server):
    # The page itself is public (it asks for the key); only /v1 needs it.
    status, headers, body = request("GET", server.url_root + "/")
    assert status == 200 and b"<title>minivllm chat</title>" in body
