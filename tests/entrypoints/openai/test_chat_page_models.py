"""The chat page's model picker on a many-model server, in a real headless browser: every
model is offered with its state, and the one picked answers (its engine core started by
that first message)."""

from __future__ import annotations

import json
import os

import pytest

from tests.entrypoints.openai import test_chat_page as chat_page
from tests.entrypoints.openai.test_chat_page import _ask, _last_answer, _set, _wait
from tests.entrypoints.openai.utils import RemoteServer, request

pytestmark = pytest.mark.e2e
browser = chat_page.browser  # the same headless chromium fixture


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_path):
    folder = tmp_path_factory.mktemp("chat-models")
    for name in ("alpha", "beta"):
        os.symlink(smollm2_path, folder / f"{name}.gguf")
    remote = RemoteServer(
        ["--models-dir", str(folder), "--max-model-len", "512"],
        env={"MINIVLLM_CPU_KVCACHE_SPACE": "0.05"},
    )
    yield remote
    remote.stop()


def test_the_picker_offers_every_model_and_the_picked_one_answers(server, browser):
    from selenium.webdriver.support.ui import Select

    driver = browser
    driver.get(server.url_root + "/")
    picker = driver.find_element("id", "model-picker")
    _wait(lambda: picker.is_displayed(), "the model picker")
    options = [o.text for o in Select(picker).options]
    assert options == ["alpha (unloaded)", "beta (unloaded)"]
    Select(picker).select_by_value("beta")
    driver.find_element("id", "toggle-settings").click()
    _set(driver, "max_tokens", "8")
    _ask(driver, "Say hello.")
    answer = _last_answer(driver)
    _wait(lambda: "done" in answer.get_attribute("class"), "the answer to finish")
    assert answer.find_element("css selector", ".content").text.strip()
    _, _, body = request("GET", server.url_for("v1/models"))
    states = {card["id"]: card["state"] for card in json.loads(body)["data"]}
    assert states == {"alpha": "unloaded", "beta": "loaded"}
