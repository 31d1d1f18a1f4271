"""The status page in headless Chromium: the browser fixture and the page helpers the real
status-page tests share (tests/real/test_status_real.py, tests/real/test_browser_guard_real.py)."""
from __future__ import annotations

import shutil
import time

import openai
import pytest

from tests.conftest import Stack

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update",
                  "--disable-sync"]


def ask(stack: Stack, session_id: str, text: str = "Say hello.") -> None:
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="x", timeout=120,
                           default_headers={"X-Session-Id": session_id})
    reply = client.chat.completions.with_raw_response.create(
        model="m", max_tokens=8, messages=[{"role": "user", "content": text}])
    assert reply.headers["X-KVProxy-Session"] == session_id


@pytest.fixture(scope="module")
def browser():
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.fail("chromium is not installed: 'make test' installs it (apt-get install chromium)")
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        # Playwright gives every launch a fresh temporary profile (--user-data-dir).
        launched = p.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS, timeout=60000)
        yield launched
        launched.close()


def open_page(browser, stack: Stack, **options):
    page = browser.new_page(**options)
    page.set_default_timeout(30000)
    problems, urls = [], []
    page.on("console", lambda m: m.type == "error" and problems.append(m.text))
    page.on("pageerror", lambda exc: problems.append(str(exc)))
    page.on("request", lambda r: urls.append(r.url))
    page.goto(stack.url + "/status")
    return page, problems, urls


def wait_until(page, expression: str, arg=None, timeout: float = 30) -> None:
    """Poll a JS expression until it is true. (Playwright's wait_for_function evaluates
    strings with eval, which the page's Content-Security-Policy rightly forbids.)"""
    deadline = time.monotonic() + timeout
    while not page.evaluate(expression, arg):
        if time.monotonic() > deadline:
            raise AssertionError(f"still false after {timeout} s: {expression}")
        time.sleep(0.1)


def slot_shows(page, session_id: str) -> None:
    wait_until(page, "id => (document.querySelector('#slots td.session') || {}).textContent === id",
               session_id)
