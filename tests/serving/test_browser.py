"""The chat UI in a real browser (Debian chromium via Playwright) against the real SmolLM2.

Skipped, with the reason, when /usr/bin/chromium or playwright is missing (``.ci/run`` installs
chromium; no browser is ever downloaded).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import LiveServer, wait_idle

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]

pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM),
                                reason=f"{CHROMIUM} not installed (apt-get install chromium); browser tests skipped")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


def _open(browser: Any, url: str, temperature: str | None = "0", max_new_tokens: str = "40") -> Any:
    page = browser.new_context(viewport={"width": 1280, "height": 1000}).new_page()
    page.goto(url + "/")
    page.get_by_placeholder("Type a message...").wait_for(timeout=30_000)
    page.get_by_text("Sampling").click()
    if temperature is not None:
        page.get_by_label("number input for Temperature (0 = greedy)").fill(temperature)
    box = page.get_by_label("number input for Max new tokens")
    box.fill(max_new_tokens)
    box.press("Tab")  # commits the value
    return page


def _send(page: Any, text: str) -> None:
    box = page.get_by_placeholder("Type a message...")
    box.fill(text)
    box.press("Enter")


def _bot_texts(page: Any) -> list[str]:
    return page.get_by_test_id("bot").all_inner_texts()


def _wait_for(pred: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_ask_capital_streams_paris(browser: Any, real_server: LiveServer) -> None:
    page = _open(browser, real_server.url)
    _send(page, "What is the capital of France?")
    seen: list[str] = []

    def done() -> bool:
        texts = _bot_texts(page)
        if texts:
            seen.append(texts[0])
        return any("tokens/s" in t for t in texts)

    _wait_for(done, 90, "the reply and its stats line")
    text = "\n".join(_bot_texts(page))
    assert "Paris" in text and "time to first token" in text
    assert len({s for s in seen if s}) > 1  # the reply grew on screen: streamed, not one blob
    page.context.close()


def test_stop_aborts_the_engine_request(browser: Any, real_server: LiveServer) -> None:
    page = _open(browser, real_server.url, temperature="0.8", max_new_tokens="400")
    _send(page, "Write a very long story about a dragon who learns to bake bread.")
    _wait_for(lambda: sum(len(t) for t in _bot_texts(page)) > 40, 90, "the reply to start")
    assert httpx.get(f"{real_server.url}/stats").json()["num_running"] == 1
    page.locator("button.stop-button").click()
    stats = wait_idle(real_server.url, timeout=15)  # running 0, all blocks free
    assert stats["num_running"] == 0
    frozen = _bot_texts(page)
    time.sleep(1.0)
    assert _bot_texts(page) == frozen  # nothing more arrives after Stop
    page.context.close()


def test_two_pages_at_once(browser: Any, real_server: LiveServer) -> None:
    pages = [_open(browser, real_server.url, temperature="0.3", max_new_tokens="24") for _ in range(2)]
    _send(pages[0], "Name a fruit.")
    _send(pages[1], "Name a color.")
    _wait_for(lambda: all(any("tokens/s" in t for t in _bot_texts(p)) for p in pages), 120, "both replies")
    for p in pages:
        assert len(_bot_texts(p)[0].split("tokens/s")[0]) > 10
        p.context.close()
    wait_idle(real_server.url)


def test_long_conversation_trimmed_with_notice(browser: Any, fake_server: LiveServer) -> None:
    """Fake engine (512-token context): the third long turn drops the oldest ones, visibly, no crash."""
    page = _open(browser, fake_server.url, temperature=None, max_new_tokens="150")
    for i in range(3):
        box = page.get_by_test_id("textbox").last  # the placeholder is gone after the first turn
        box.fill(f"message {i} " + "blah " * 20)
        box.press("Enter")
        _wait_for(lambda i=i: sum("tokens/s" in t for t in _bot_texts(page)) > i, 30, f"reply {i}")
    assert "oldest messages were left out" in "\n".join(_bot_texts(page))
    page.context.close()


def test_json_schema_box_constrains_and_formats_the_reply(browser: Any, real_server: LiveServer) -> None:
    import json

    import jsonschema

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "legs": {"type": "integer", "minimum": 0, "maximum": 8}},
              "required": ["name", "legs"], "additionalProperties": False}
    page = _open(browser, real_server.url, max_new_tokens="80")
    editor = page.locator(".cm-content").last  # the JSON schema box (a code editor) in the Sampling panel
    editor.click()
    editor.fill(json.dumps(schema))
    _send(page, "Describe a cat.")
    _wait_for(lambda: any("tokens/s" in t for t in _bot_texts(page)), 90, "the reply and its stats line")
    code = page.get_by_test_id("bot").locator("pre code").first.inner_text()
    jsonschema.validate(json.loads(code), schema)
    assert "\n  \"legs\"" in code  # pretty-printed, indented by 2
    page.context.close()
