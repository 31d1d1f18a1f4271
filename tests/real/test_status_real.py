"""The status page in a real browser (headless Chromium) and ``python -m kvproxy``, both
against a running kvproxy and llama-server with an admin token set."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from kvproxy.slots.restore_check import CHECK_FILE
from tests.conftest import Stack
from tests.status_page import ask, browser, open_page, slot_shows, wait_until  # noqa: F401 - fixture

pytestmark = pytest.mark.real

TOKEN = "op-t0ken-5e1f"
REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "var" / "test-artifacts"


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """llama-server plus kvproxy with an admin token."""
    s = Stack(tmp_path_factory.mktemp("status"), KVPROXY_ADMIN_TOKEN=TOKEN).start()
    yield s
    s.stop()


def admin(stack: Stack, path: str) -> requests.Response:
    return requests.get(stack.url + path, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)


def test_page_in_a_browser(guarded, browser, tmp_path):
    ask(guarded, "alice")
    page, problems, urls = open_page(browser, guarded, viewport={"width": 1280, "height": 900})

    # A token is set: the page asks for it before it shows anything.
    assert page.is_visible("#token-form") and not page.is_visible("#board")
    page.fill("#token", TOKEN)
    page.press("#token", "Enter")
    slot_shows(page, "alice")
    assert "alice" in page.inner_text("#sessions tbody")
    assert page.inner_text("#llama") == "llama-server ok"

    # Another request shows up on its own: no reload (the marker would be gone).
    page.evaluate("window.stillTheSamePage = true")
    ask(guarded, "bob")
    slot_shows(page, "bob")
    wait_until(page, "document.querySelector('#swaps tbody').textContent.includes('bob')")
    assert page.evaluate("window.stillTheSamePage") is True

    # Sorting: most recently used first, then by id when its header is clicked.
    first_id = "document.querySelector('#sessions tbody td.id').textContent"
    wait_until(page, f"{first_id} === 'bob'")
    page.click("#sessions th[data-key=id]")
    assert page.evaluate(first_id) == "alice"
    page.click("#sessions th[data-key=id]")
    assert page.evaluate(first_id) == "bob"

    # Delete alice through her row's button.
    alice_file = next(s["file"] for s in admin(guarded, "/api/sessions").json()
                      if s["session_id"] == "alice")
    assert (guarded.slot_dir / alice_file).exists()
    page.once("dialog", lambda dialog: dialog.accept())
    page.click("#sessions button[data-action=delete][data-id=alice]")
    wait_until(page, "document.getElementById('message').textContent === 'Deleted session alice.'")
    wait_until(page, "!document.querySelector('#sessions button[data-id=alice]')")
    assert [s["session_id"] for s in admin(guarded, "/api/sessions").json()] == ["bob"]
    assert not (guarded.slot_dir / alice_file).exists()

    # An id is shown as text, never run as markup.
    hostile = '<img src=x onerror="window.pwned=1">'
    ask(guarded, hostile)
    slot_shows(page, hostile)
    assert page.evaluate("window.pwned") is None and not page.query_selector("#board img")

    wait_until(page, "document.querySelector('#slots .badge').textContent === 'idle'")

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    for target in (ARTIFACTS / "status.png", tmp_path / "status.png"):
        page.screenshot(path=str(target), full_page=True)
    assert problems == [], f"console errors: {problems}"
    assert not [u for u in urls if TOKEN in u], "the token never goes into a URL"
    assert all(u.startswith(guarded.url) or u.startswith("data:") for u in urls), urls
    page.close()


def test_page_on_a_phone_in_dark_mode(guarded, browser, tmp_path):
    ask(guarded, "phoebe")
    page, problems, _ = open_page(browser, guarded, viewport={"width": 390, "height": 844},
                                  color_scheme="dark", device_scale_factor=2)
    page.fill("#token", TOKEN)
    page.press("#token", "Enter")
    page.wait_for_selector("#slots td.session")
    page.wait_for_selector("#sessions tbody button[data-action=delete]")
    assert page.evaluate("document.documentElement.scrollWidth") <= 390, "no sideways scrolling"
    delete = page.query_selector("#sessions tbody button[data-action=delete]").bounding_box()
    assert delete["x"] + delete["width"] <= 390, "the delete button is on screen"
    background = page.evaluate("getComputedStyle(document.body).backgroundColor")
    assert background == "rgb(15, 19, 24)", "dark colours follow prefers-color-scheme"
    page.screenshot(path=str(ARTIFACTS / "status-phone-dark.png"), full_page=True)
    assert problems == [], problems
    page.close()


def test_clear_and_reset_buttons(guarded, browser):
    ask(guarded, "erin")
    page, _, urls = open_page(browser, guarded)
    page.fill("#token", TOKEN)
    page.press("#token", "Enter")
    slot_shows(page, "erin")
    page.once("dialog", lambda dialog: dialog.accept())
    page.click("#slots button[data-action=clear]")
    slot_shows(page, "default")
    assert admin(guarded, "/api/sessions/current").json()["session_id"] == "default"
    assert "erin" in page.inner_text("#sessions tbody"), "clearing saves the session first"

    # Restoring switched off for another llama-server sharing the folder: the page says so,
    # and its Reset button switches it on again.
    check_file = guarded.slot_dir / CHECK_FILE
    check_file.write_text(json.dumps({"another-llama-server": {
        "misses": 0, "off_since": "2026-01-01T00:00:00+00:00", "off_until": "2999-01-01T00:00:00+00:00"}}))
    shows_off = "document.getElementById('restore-check').textContent.includes('Switched off for 1 other')"
    wait_until(page, shows_off)
    page.click("#reset-restore-check")
    wait_until(page, "document.getElementById('message').textContent === 'Restore check reset.'")
    wait_until(page, f"!({shows_off})")
    assert json.loads(check_file.read_text()) == {}
    assert any(u.endswith("/api/sessions/restore-check/reset") for u in urls)
    page.close()


def test_wrong_token_is_asked_again(guarded, browser):
    page, _, _ = open_page(browser, guarded)
    page.fill("#token", "wrong")
    page.press("#token", "Enter")
    wait_until(page, "document.getElementById('message').textContent.includes('token')")
    assert page.is_visible("#token-form") and not page.is_visible("#board")
    assert page.evaluate("sessionStorage.length") == 0, "a refused token is not kept"
    page.close()


# -- the command line against the same kvproxy -----------------------------------
def kvproxy_cli(stack: Stack, *args: str, token: str = TOKEN) -> subprocess.CompletedProcess:
    env = {**os.environ, "KVPROXY_URL": stack.url, "KVPROXY_ADMIN_TOKEN": token}
    return subprocess.run([sys.executable, "-m", "kvproxy", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)


def test_command_line(guarded):
    ask(guarded, "carol", "Name three colours.")
    ask(guarded, "dave")
    ask(guarded, "carol", "Name three colours.")

    ps = kvproxy_cli(guarded, "ps")
    assert ps.returncode == 0, ps.stderr
    assert ps.stdout.splitlines()[1].split()[:3] == ["0", "carol", "idle"]
    assert "llama-server ok: SmolLM2" in ps.stdout

    listed = json.loads(kvproxy_cli(guarded, "sessions", "--json").stdout)
    carol = next(s for s in listed if s["id"] == "carol")
    assert carol["last_cache"] == "restored" and carol["restores"] == 1 and carol["tokens"] > 0
    table = kvproxy_cli(guarded, "sessions").stdout
    assert table.splitlines()[0].split()[0] == "SESSION" and "dave" in table

    stats = json.loads(kvproxy_cli(guarded, "stats", "--json").stdout)
    assert stats["stats"]["outcomes"]["restored"] >= 1
    assert stats["stats"]["tokens"]["reused"] > 0 and stats["stats"]["tokens"]["computed"] > 0
    assert stats["disk"]["used_bytes"] > 0 and stats["disk"]["free_bytes"] > 0
    assert "hit ratio" in kvproxy_cli(guarded, "stats").stdout

    assert kvproxy_cli(guarded, "rm", "dave").returncode == 0
    missing = kvproxy_cli(guarded, "rm", "dave")
    assert missing.returncode == 1 and missing.stderr == "kvproxy: no saved session 'dave'\n"

    cleared = kvproxy_cli(guarded, "clear")
    assert cleared.returncode == 0
    assert admin(guarded, "/api/sessions/current").json()["session_id"] == "default"
    assert json.loads(kvproxy_cli(guarded, "ps", "--json").stdout)["slots"][0]["session_id"] == "default"

    refused = kvproxy_cli(guarded, "ps", token="wrong")
    assert refused.returncode == 4 and refused.stdout == "" and len(refused.stderr.splitlines()) == 1

